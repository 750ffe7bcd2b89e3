"""The worked examples of docs/operators.md (§1.9, §3.9 with and without bias, §4.7, §5.8) through
the moegrad public API, checked against the values listed there to their listed precision (plus
the output dtype's rounding from the tolerance table)."""

import numpy as np
import torch

import moegrad
from conftest import tolerance, unit_roundoff
from test_reference import (EX19_EXPECTED, EX19_GRADY, EX19_IDX, EX19_XNORM, EX39, EX39_GRAD_EX,
                            EX39_GRAD_SCALES_BIAS, EX39_GRAD_SCALES_NOBIAS, EX47_BIAS, EX47_EID,
                            EX47_EX, EX47_IDX, EX47_OUT, EX47_SCALES, EX47_X1, EX58_GW, EX58_GX0,
                            EX58_GX1, EX58_SUM_ABS_GX, EX58_SUM_GW, EX58_SUM_GX,
                            example_5_8_inputs)


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def _check_listed(out, listed, decimals, what, n_reduce=1, scale=None, extra=0.0):
    """|out - listed| <= half a unit of the listed last digit + the dtype tolerance (+ extra)."""
    o = out.detach().double().numpy() if isinstance(out, torch.Tensor) else np.asarray(out, float)
    dt = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    lst = np.asarray(listed, dtype=np.float64)
    tol = 0.5 * 10.0 ** -decimals + tolerance(dt, np.abs(lst), scale, n_reduce) + extra
    err = np.abs(o - lst)
    assert o.shape == lst.shape, f"{what}: shape {o.shape} != {lst.shape}"
    assert np.all(err <= tol), f"{what}: got\n{o}\nlisted\n{lst}\nmax err {err.max():.3g}"


def test_example_1_9_gating_backward_through_api():
    gx = moegrad.moe_gating_top_k_backward(_t(EX19_XNORM), _t(EX19_GRADY), _t(EX19_IDX),
                                           renorm=0, norm_type=1, routed_scaling_factor=2.5,
                                           eps=1e-20)
    assert gx.dtype == torch.float32 and gx.shape == (4, 8)
    expected = np.zeros((4, 8))
    for (i, j), v in EX19_EXPECTED.items():
        expected[i, j] = v
    _check_listed(gx, expected, 6, "§1.9 gradX")
    assert torch.all(gx[torch.from_numpy(expected == 0)] == 0), "unselected experts must be 0"


def test_example_3_9_finalize_grad_with_bias_through_api():
    e = {k: _t(v) for k, v in EX39.items()}
    gex, gsc = moegrad.moe_finalize_routing_grad(
        e["grad_y"], e["expanded_row_idx"], e["expanded_x"], e["scales"], e["expert_idx"],
        e["bias"], drop_pad_mode=0)
    _check_listed(gex, EX39_GRAD_EX, 6, "§3.9 gradExpandedX")
    _check_listed(gsc, EX39_GRAD_SCALES_BIAS, 6, "§3.9 gradScales (bias)")


def test_example_3_9_finalize_grad_without_bias_through_api():
    e = {k: _t(v) for k, v in EX39.items()}
    gex, gsc = moegrad.moe_finalize_routing_grad(
        e["grad_y"], e["expanded_row_idx"], expanded_x=e["expanded_x"], scales=e["scales"],
        drop_pad_mode=0)
    _check_listed(gex, EX39_GRAD_EX, 6, "§3.9 gradExpandedX (no bias)")
    _check_listed(gsc, EX39_GRAD_SCALES_NOBIAS, 6, "§3.9 gradScales (no bias)")


def test_example_4_7_finalize_forward_through_api():
    out = moegrad.moe_finalize_routing(_t(EX47_EX), _t(EX47_IDX), x1=_t(EX47_X1),
                                       x2=_t(EX47_X1), bias=_t(EX47_BIAS), scales=_t(EX47_SCALES),
                                       expert_idx=_t(EX47_EID), drop_pad_mode=0, k=2)
    assert out.dtype == torch.float32
    _check_listed(out, EX47_OUT, 2, "§4.7 out")


def test_example_5_8_swiglu_backward_through_api():
    gy, x, w, yo, gi = (_t(a) for a in example_5_8_inputs())
    gx, gw = moegrad.swiglu_group_quant_backward(gy, x, weight=w, y_origin=yo, group_index=gi,
                                                 clamp_limit=1.0)
    assert gx.dtype == torch.float16 and gx.shape == (512, 1024)
    assert gw.dtype == torch.float32 and gw.shape == (512,)
    _check_listed(gx[0, :10], EX58_GX0, 5, "§5.8 gradX[0,0:10]")
    _check_listed(gx[1, :10], EX58_GX1, 5, "§5.8 gradX[1,0:10]")
    assert torch.all(gx[0, 512:522] == 0), "§5.8 gradX[0,512:522] must be masked to 0"
    _check_listed(gw[:5], EX58_GW, 3, "§5.8 gradWeight[0:5]", n_reduce=512,
                  scale=np.array(EX58_GW))
    gx64 = gx.double()
    abs_sum = float(gx64.abs().sum())
    # the sums of fp16 values: allow the listed precision plus one fp16 rounding step on 1e-3 of
    # the elements (fp32 results that fall on the other side of an fp16 rounding midpoint)
    slack = 1e-3 * 2 * unit_roundoff(torch.float16) * abs_sum
    _check_listed(np.array(float(gx64.sum())), np.array(EX58_SUM_GX), 2, "§5.8 sum gradX",
                  extra=slack)
    _check_listed(np.array(abs_sum), np.array(EX58_SUM_ABS_GX), 2, "§5.8 sum |gradX|",
                  extra=slack)
    _check_listed(np.array(float(gw.double().sum())), np.array(EX58_SUM_GW), 2,
                  "§5.8 sum gradWeight", n_reduce=512, scale=np.array(EX58_SUM_GW))


def test_worked_example_2_7_gating_forward_ties_and_bias():
    """§2.7: equal sigmoid scores go to the lower expert; the bias changes the choice only."""
    x = torch.tensor([[0.0, 2.0, -1.0, 2.0]])
    y, idx, _ = moegrad.moe_gating_top_k(x, 2, norm_type=1)
    assert idx.tolist() == [[1, 3]]
    torch.testing.assert_close(y, torch.tensor([[0.5, 0.5]]))
    y, idx, _ = moegrad.moe_gating_top_k(x, 2, bias=torch.tensor([0.0, 0.0, 0.7, 0.0]),
                                         norm_type=1)
    assert idx.tolist() == [[2, 1]]
    torch.testing.assert_close(y, torch.tensor([[0.233915, 0.766085]]), atol=1e-6, rtol=0)
