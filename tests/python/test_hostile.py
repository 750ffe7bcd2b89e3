"""Hostile input through the Python front (docs/decisions.md L50-L53).

Errors name the argument that is actually wrong (the odd one out when several tensors carry the
same size), attributes that contradict a tensor or lie outside their range are errors (finalize
routing's ``k``), count sums never overflow or wrap (SwiGLU ``group_index``), and dtype messages
name the dtype seen and the accepted ones once each.
"""

from __future__ import annotations

import re

import pytest
import torch

import moegrad

I64_MAX, I64_MIN = 2**63 - 1, -(2**63)
FINALIZE, TILING, PARAM_INVALID = 561103, 561002, 161002


def _blamed(err: moegrad.MoeError) -> str:
    """The argument a message blames: "<op>: <argument>: <rule>; got <value>"."""
    parts = str(err).split(": ")
    assert len(parts) >= 3, str(err)
    return parts[1]


def _raises(code, arg, fn, *args, **kw):
    with pytest.raises(moegrad.MoeError) as info:
        fn(*args, **kw)
    assert info.value.code == code, str(info.value)
    assert _blamed(info.value) == arg, f"blamed the wrong argument: {info.value}"
    return str(info.value)


def _finalize_inputs(R=3, K=2, H=4, E=3):
    g = torch.Generator().manual_seed(5)
    return dict(expanded_x=torch.randn(R * K, H, generator=g),
                expanded_row_idx=torch.randperm(R * K, generator=g).to(torch.int32),
                x1=torch.randn(R, H, generator=g),
                scales=torch.rand(R, K, generator=g),
                expert_idx=torch.randint(0, E, (R, K), generator=g, dtype=torch.int32),
                bias=torch.randn(E, H, generator=g))


# ---- finalize routing's k (L51) ----

@pytest.mark.parametrize("k", [0, -1, -(2**40)])
def test_finalize_k_below_one_is_an_error_even_when_unused(k):
    _raises(FINALIZE, "k", moegrad.moe_finalize_routing, **_finalize_inputs(), k=k)


@pytest.mark.parametrize("k", [3, 6])
def test_finalize_k_contradicting_scales_is_an_error(k):
    msg = _raises(FINALIZE, "k", moegrad.moe_finalize_routing, **_finalize_inputs(), k=k)
    assert re.search(rf"got {k}\b", msg), msg


def test_finalize_k_contradicting_x1_rows_is_an_error():
    a = _finalize_inputs()
    for name in ("scales", "expert_idx", "bias"):
        a[name] = None
    # len(idx) = 6 with 3 rows of x1 gives K = 2; k = 3 contradicts it.
    _raises(FINALIZE, "k", moegrad.moe_finalize_routing, **a, k=3)


def test_finalize_k_matching_or_default_is_accepted():
    a = _finalize_inputs()
    y_default = moegrad.moe_finalize_routing(**a)
    y_k2 = moegrad.moe_finalize_routing(**a, k=2)
    assert torch.equal(y_default, y_k2)


# ---- the odd one out is named (L50) ----

def test_finalize_forward_names_the_tensor_with_the_odd_token_count():
    a = _finalize_inputs()
    a["scales"] = a["scales"][:2]
    _raises(FINALIZE, "scales", moegrad.moe_finalize_routing, **a)
    a = _finalize_inputs()
    a["x1"] = a["x1"][:, :3]
    _raises(FINALIZE, "x1", moegrad.moe_finalize_routing, **a)


def test_finalize_grad_names_grad_y_when_scales_and_expert_idx_agree():
    a = _finalize_inputs()
    gy = torch.randn(2, 4)
    _raises(FINALIZE, "grad_y", moegrad.moe_finalize_routing_grad, gy,
            a["expanded_row_idx"], a["expanded_x"], a["scales"], a["expert_idx"], a["bias"])


def test_gating_backward_names_x_norm_when_grad_y_and_expert_idx_agree():
    x_norm = torch.rand(5, 8)
    gy = torch.randn(4, 2)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)
    _raises(PARAM_INVALID, "x_norm", moegrad.moe_gating_top_k_backward, x_norm, gy, idx)


def test_swiglu_backward_names_x_when_grad_y_and_y_origin_agree():
    gy, yo = torch.randn(4, 3), torch.randn(4, 3)
    x, w = torch.randn(5, 6), torch.rand(4)
    _raises(TILING, "x", moegrad.swiglu_group_quant_backward, gy, x, w, yo)
    # rank: grad_y and y_origin of rank 3, x of rank 2
    _raises(TILING, "x", moegrad.swiglu_group_quant_backward, gy.reshape(2, 2, 3),
            torch.randn(4, 6), w, yo.reshape(2, 2, 3))


# ---- counts never overflow (L52) ----

@pytest.mark.parametrize("counts, kept", [
    ([2, 1], 3),
    ([I64_MAX, I64_MAX], 6),                       # int64 would wrap to -2
    ([I64_MAX, 1], 6),                             # int64 would wrap to INT64_MIN
    ([I64_MIN, 5], 0),
    ([I64_MIN, I64_MIN, 4], 0),                    # int64 would wrap to 4
    ([I64_MAX, I64_MAX, I64_MIN, I64_MIN, 4], 2),  # exact: -2 + 4
], ids=["small", "max+max", "max+1", "min+5", "min+min+4", "exact"])
def test_group_index_sum_is_exact(counts, kept):
    T, H = 6, 3
    x = torch.randn(T, 2 * H, generator=torch.Generator().manual_seed(1)) + 3.0
    gi = torch.tensor(counts, dtype=torch.int64)
    y = moegrad.swiglu_group(x, group_index=gi)
    full = moegrad.swiglu_group(x)
    assert torch.equal(y[:kept], full[:kept])
    assert torch.all(y[kept:] == 0)
    # the plain-PyTorch reference shipped with the package sums exactly too
    from moegrad import reference_torch
    y_ref = reference_torch.swiglu_group(x, group_index=gi)
    assert torch.all(y_ref[kept:] == 0) and torch.all(y_ref[:kept] != 0)
    gy = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    gx, _ = moegrad.swiglu_group_quant_backward(gy, x, group_index=gi)
    gx_full, _ = moegrad.swiglu_group_quant_backward(gy, x)
    assert torch.equal(gx[:kept], gx_full[:kept])
    assert torch.all(gx[kept:] == 0)


def test_finalize_grad_huge_capacity_is_an_error_not_an_overflow():
    gy = torch.randn(3, 4)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    _raises(FINALIZE, "expert_capacity", moegrad.moe_finalize_routing_grad, gy, idx,
            drop_pad_mode=1, expert_num=2**40, expert_capacity=2**40)
    # scales with rows but K = 0 is the scales' error, not "absent" (only [0, K] at R = 0 is)
    _raises(FINALIZE, "scales", moegrad.moe_finalize_routing_grad, gy, idx[:0],
            torch.randn(0, 4), torch.rand(3, 0))
    # active_num outside (0, R*K) is ignored, a negative one too (docs/operators.md §3.4)
    base = moegrad.moe_finalize_routing_grad(gy, idx)
    for a in (-1, -2**40, 3, 2**40):
        got = moegrad.moe_finalize_routing_grad(gy, idx, active_num=a)
        assert all(torch.equal(u, v) for u, v in zip(base, got)), a


# ---- dtype messages (L53) ----

@pytest.mark.parametrize("dtype, name", [(torch.float64, "float64"), (torch.int8, "int8"),
                                         (torch.int16, "int16"), (torch.uint8, "uint8"),
                                         (torch.bool, "bool"), (torch.complex64, "complex64")])
def test_dtype_messages_name_the_dtype_seen(dtype, name):
    x = torch.zeros(4, 8, dtype=dtype)
    msg = _raises(PARAM_INVALID, "x", moegrad.swiglu_group, x)
    assert re.search(rf"got {name}\b", msg), msg
    for accepted in ("float32", "float16", "bfloat16"):
        assert len(re.findall(rf"\b{accepted}\b", msg)) == 1, msg


def test_same_dtype_messages_do_not_repeat_the_name():
    x_norm, gy = torch.rand(4, 8), torch.randn(4, 2)
    # int16 indices are not converted (only int64 is, D20)
    idx = torch.zeros(4, 2, dtype=torch.int16)
    msg = _raises(PARAM_INVALID, "expert_idx", moegrad.moe_gating_top_k_backward, x_norm, gy, idx)
    assert "must be int32; got int16" in msg, msg
    msg = _raises(PARAM_INVALID, "x_norm", moegrad.moe_gating_top_k_backward,
                  x_norm.double(), gy, idx.int())
    assert "must be float32; got float64" in msg, msg


# ---- fake kernels (torch.compile traces them first) ----

_X1, _I1 = torch.randn(6), torch.tensor([0, 1, 2, 3, 0, 1], dtype=torch.int32)
_RANK_CASES = [
    ("moe_gating_top_k", lambda x, i: torch.ops.moegrad.moe_gating_top_k(x, 2)),
    ("moe_gating_replay x", lambda x, i: torch.ops.moegrad.moe_gating_replay(x, i)),
    ("moe_gating_replay expert_idx",
     lambda x, i: torch.ops.moegrad.moe_gating_replay(x.reshape(6, 1).expand(6, 4), i)),
    ("moe_init_routing x", lambda x, i: torch.ops.moegrad.moe_init_routing(x, i, 0, 0, 4)),
    ("moe_init_routing expert_idx",
     lambda x, i: torch.ops.moegrad.moe_init_routing(x.reshape(3, 2), i, 0, 0, 4)),
    ("moe_finalize_routing_grad", lambda x, i: torch.ops.moegrad.moe_finalize_routing_grad(x, i)),
    ("moe_finalize_routing_grad scales",
     lambda x, i: torch.ops.moegrad.moe_finalize_routing_grad(x.reshape(3, 2), i, x.reshape(6, 1),
                                                             x)),
    ("moe_finalize_routing_bias_grad expert_idx",
     lambda x, i: torch.ops.moegrad.moe_finalize_routing_bias_grad(x.reshape(3, 2), i, None, 4)),
]


@pytest.mark.parametrize("call", [c[1] for c in _RANK_CASES], ids=[c[0] for c in _RANK_CASES])
def test_fake_kernels_raise_the_native_rank_error(call):
    """A tensor of the wrong rank fails in the fake kernel (tracing) with the MoeError the native
    validation gives, not an IndexError from the fake's shape arithmetic."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with pytest.raises(moegrad.MoeError) as real:
        call(_X1, _I1)
    with FakeTensorMode() as mode:
        with pytest.raises(moegrad.MoeError) as fake:
            call(mode.from_tensor(_X1), mode.from_tensor(_I1))
    assert (fake.value.code, str(fake.value)) == (real.value.code, str(real.value))


def test_raw_front_refuses_outputs_overlapping_inputs(rng):
    """moegrad._C with caller outputs (L232): an output over an input's memory, or grad_y used
    as grad_expanded_x, is MoeError 161002 naming the output, and nothing is written; grad_x
    exactly over x (the documented in-place swiglu gradient, L228) equals a separate grad_x."""
    from moegrad import _C
    x = torch.randn(64, 64)
    xa = x.clone()
    with pytest.raises(moegrad.MoeError, match=r"swiglu_group: y: output memory must not "
                                               r"overlap x's") as e:
        _C.swiglu_group(xa, None, None, -1.0, xa.view(-1)[64 * 32:].view(64, 32))
    assert e.value.code == 161002 and torch.equal(xa, x)
    gy, idx = torch.randn(8, 4), torch.randperm(8, dtype=torch.int32)
    gy0, gs = gy.clone(), torch.full((8, 1), 7.0)
    with pytest.raises(moegrad.MoeError, match=r"grad_expanded_x: output memory must not "
                                               r"overlap grad_y's"):
        _C.moe_finalize_routing_grad(gy, idx, None, None, None, None, 0, 0, 0, 0, gy, gs)
    assert torch.equal(gs, torch.full((8, 1), 7.0)) and torch.equal(gy, gy0)
    g = torch.randn(64, 32)
    sep = moegrad.swiglu_group_quant_backward(g, x)[0]
    _C.swiglu_group_quant_backward(g, xa, None, None, None, -1.0, xa, None)
    assert torch.equal(xa, sep)


def test_raw_front_names_a_tensor_of_too_high_rank():
    from moegrad import _C
    x = torch.zeros([1] * 17)
    with pytest.raises(moegrad.MoeError, match=r"^swiglu_group: x: rank must be in \[0, 16\]; "
                                               r"got 17") as e:
        _C.swiglu_group(x, None, None, -1.0, torch.zeros([1] * 16 + [0]))
    assert e.value.code == 161002
