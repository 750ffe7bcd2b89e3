"""MoeFinalizeRouting forward (§4, D7, D8, L4, L5) and MoeFinalizeRoutingV2Grad (§3, D4, D5,
D7, L6) against the float64 reference, through the public API and through moegrad._C with
poisoned outputs."""

import numpy as np
import pytest
import torch

import moegrad
import reference as ref
from conftest import (assert_close_to_ref, dtype_params, poison, rand_droppad_idx,
                      rand_expert_idx, rand_perm_idx, randn)

APIS = ("public", "lowlevel")
api_params = pytest.mark.parametrize("api", APIS)
MODES = pytest.mark.parametrize("drop_pad_mode", [0, 1, 2, 3],
                                ids=["dropless_col", "droppad_col", "dropless_row",
                                     "droppad_row"])


def _i32(t):
    return None if t is None else t.to(torch.int32).contiguous()


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
def run_forward(api, expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None,
                expert_idx=None, drop_pad_mode=0, R=None, K=1):
    if api == "public":
        return moegrad.moe_finalize_routing(expanded_x, expanded_row_idx, x1=x1, x2=x2,
                                            bias=bias, scales=scales, expert_idx=expert_idx,
                                            drop_pad_mode=drop_pad_mode, k=K)
    out = poison(torch.empty((R, expanded_x.shape[-1]), dtype=expanded_x.dtype))
    moegrad._C.moe_finalize_routing(expanded_x, _i32(expanded_row_idx), x1, x2, bias, scales,
                                    _i32(expert_idx), drop_pad_mode, out)
    return out


def check_forward(out, expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None,
                  expert_idx=None, drop_pad_mode=0, R=None, K=1):
    kw = dict(x1=x1, x2=x2, bias=bias, scales=scales, expert_idx=expert_idx,
              drop_pad_mode=drop_pad_mode, R=R, K=K)
    expected = ref.moe_finalize_routing(expanded_x, expanded_row_idx, **kw)
    mag = ref.finalize_routing_magnitude(expanded_x, expanded_row_idx, **kw)
    assert out.dtype == expanded_x.dtype, out.dtype
    assert_close_to_ref(out, expected, expanded_x.dtype, scale=mag, n_reduce=K + 2, what="y")


def make_forward_case(rng, dtype, drop_pad_mode, R, K, H, E, C=None, scales=True, bias=True,
                      x1=True, x2=True, n_keep=None, rows=None):
    """A valid input set. rows (dropless only) < R*K truncates expanded_x (L5)."""
    droppad = drop_pad_mode in (1, 3)
    if droppad:
        C = C if C is not None else int(rng.integers(1, 6))
        ex = randn((E, C, H), dtype, rng)
        idx = rand_droppad_idx(R * K, E, C, rng, n_keep=n_keep)
    else:
        ex = randn((R * K if rows is None else rows, H), dtype, rng)
        idx = rand_perm_idx(R * K, rng)
    case = dict(expanded_x=ex, expanded_row_idx=idx, R=R, K=K, drop_pad_mode=drop_pad_mode)
    if scales:
        case["scales"] = randn((R, K), dtype, rng)
    if bias:
        case["bias"] = randn((E, H), dtype, rng)
        case["expert_idx"] = rand_expert_idx(R, K, E, rng, distinct=False)
    if x1:
        case["x1"] = randn((R, H), dtype, rng)
        if x2:
            case["x2"] = randn((R, H), dtype, rng)
    return case


@api_params
@MODES
@dtype_params
def test_finalize_forward_random_matches_reference(dtype, drop_pad_mode, api, rng):
    R = int(rng.integers(1, 40))
    K = int(rng.integers(1, 5))
    H = int(rng.choice([1, 7, 16, 33, 257]))
    E = int(rng.integers(1, 9))
    opts = dict(scales=True, bias=bool(rng.integers(0, 2)), x1=bool(rng.integers(0, 2)),
                x2=bool(rng.integers(0, 2)))
    case = make_forward_case(rng, dtype, drop_pad_mode, R, K, H, E, **opts)
    check_forward(run_forward(api, **case), **case)


@api_params
@MODES
@dtype_params
def test_finalize_forward_all_optional_inputs_present(dtype, drop_pad_mode, api, rng):
    case = make_forward_case(rng, dtype, drop_pad_mode, R=13, K=3, H=257, E=4)
    check_forward(run_forward(api, **case), **case)


@api_params
@MODES
@dtype_params
def test_finalize_forward_k1_without_scales_uses_unit_scales(dtype, drop_pad_mode, api, rng):
    case = make_forward_case(rng, dtype, drop_pad_mode, R=11, K=1, H=33, E=3, scales=False,
                             bias=False, x1=True, x2=False)
    check_forward(run_forward(api, **case), **case)


@api_params
@pytest.mark.parametrize("drop_pad_mode", [0, 2], ids=["dropless_col", "dropless_row"])
@dtype_params
def test_finalize_forward_k_from_index_length_without_scales(dtype, drop_pad_mode, api, rng):
    # L4: no scales, no expert_idx -> K = numel(expanded_row_idx) / R, scales = 1
    case = make_forward_case(rng, dtype, drop_pad_mode, R=7, K=3, H=20, E=2, scales=False,
                             bias=False, x1=False)
    check_forward(run_forward(api, **case), **case)


@api_params
@MODES
@dtype_params
def test_finalize_forward_bias_with_expert_idx_but_no_scales(dtype, drop_pad_mode, api, rng):
    case = make_forward_case(rng, dtype, drop_pad_mode, R=9, K=2, H=24, E=5, scales=False,
                             bias=True, x1=True, x2=True)
    check_forward(run_forward(api, **case), **case)


@api_params
@MODES
@dtype_params
def test_finalize_forward_zero_tokens(dtype, drop_pad_mode, api, rng):
    case = make_forward_case(rng, dtype, drop_pad_mode, R=0, K=2, H=16, E=3, C=2)
    out = run_forward(api, **case)
    assert tuple(out.shape) == (0, 16) and out.dtype == dtype


@api_params
@pytest.mark.parametrize("drop_pad_mode", [1, 3], ids=["droppad_col", "droppad_row"])
@dtype_params
def test_finalize_forward_dropped_slots_add_scale_times_bias(dtype, drop_pad_mode, api, rng):
    # D7: a -1 slot contributes scales * bias[expert] and no expanded row; include a case where
    # every slot is dropped and one where capacity rows stay empty
    for n_keep in (0, 5):
        case = make_forward_case(rng, dtype, drop_pad_mode, R=8, K=3, H=40, E=4, C=3,
                                 n_keep=n_keep)
        check_forward(run_forward(api, **case), **case)


@api_params
@pytest.mark.parametrize("drop_pad_mode", [0, 2], ids=["dropless_col", "dropless_row"])
@dtype_params
def test_finalize_forward_index_beyond_truncated_expanded_x_acts_as_dropped(
        dtype, drop_pad_mode, api, rng):
    # L5: expanded_x has fewer rows than R*K (active_num truncation upstream): indices >= rows
    # contribute only scales * bias
    R, K = 10, 3
    case = make_forward_case(rng, dtype, drop_pad_mode, R=R, K=K, H=17, E=3, rows=R * K - 11)
    check_forward(run_forward(api, **case), **case)


@MODES
def test_finalize_forward_accepts_int64_indices_in_python(drop_pad_mode, rng):
    case = make_forward_case(rng, torch.float32, drop_pad_mode, R=6, K=2, H=8, E=3)
    case64 = dict(case)
    case64["expanded_row_idx"] = case["expanded_row_idx"].to(torch.int64)
    case64["expert_idx"] = case["expert_idx"].to(torch.int64)
    check_forward(run_forward("public", **case64), **case)


def test_finalize_forward_column_vs_row_layout_read_different_slots():
    # out[r] = sum_k s[r,k] * ex[idx(r,k)], columns: idx[k*R + r], rows: idx[r*K + k]
    ex = torch.tensor([[1.0], [10.0], [100.0], [1000.0]])
    idx = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    col = moegrad.moe_finalize_routing(ex, idx, scales=s, drop_pad_mode=0, k=2)
    row = moegrad.moe_finalize_routing(ex, idx, scales=s, drop_pad_mode=2, k=2)
    assert col.tolist() == [[201.0], [4030.0]]
    assert row.tolist() == [[21.0], [4300.0]]


# ---------------------------------------------------------------------------------------------
# grad
# ---------------------------------------------------------------------------------------------
def run_grad(api, grad_y, expanded_row_idx, expanded_x=None, scales=None, expert_idx=None,
             bias=None, drop_pad_mode=0, active_num=0, expert_num=0, expert_capacity=0):
    if api == "public":
        return moegrad.moe_finalize_routing_grad(
            grad_y, expanded_row_idx, expanded_x=expanded_x, scales=scales,
            expert_idx=expert_idx, bias=bias, drop_pad_mode=drop_pad_mode,
            active_num=active_num, expert_num=expert_num, expert_capacity=expert_capacity)
    R, H = grad_y.shape
    n = expanded_row_idx.numel()
    if drop_pad_mode == 0:
        shape = (active_num if 0 < active_num < n else n, H)
    else:
        shape = (expert_num, expert_capacity, H)
    gex = poison(torch.empty(shape, dtype=grad_y.dtype))
    if scales is not None:
        gsc = poison(torch.empty(tuple(scales.shape), dtype=scales.dtype))
    else:
        gsc = poison(torch.empty((R, 1), dtype=grad_y.dtype))
    moegrad._C.moe_finalize_routing_grad(grad_y, _i32(expanded_row_idx), expanded_x, scales,
                                         _i32(expert_idx), bias, drop_pad_mode, active_num,
                                         expert_num, expert_capacity, gex, gsc)
    return gex, gsc


def check_grad(out, **case):
    gex, gsc = out
    gy = case["grad_y"]
    R, H = gy.shape
    exp_gex, exp_gsc = ref.moe_finalize_routing_grad(**case)
    _, mag_gsc = ref.moe_finalize_routing_grad(**case, _abs=True)
    assert gex.dtype == gy.dtype, gex.dtype
    assert_close_to_ref(gex, exp_gex, gy.dtype, what="grad_expanded_x")
    sdt = case["scales"].dtype if case.get("scales") is not None else gy.dtype
    if R == 0 and case.get("scales") is not None and tuple(gsc.shape) == (0, 1):
        # the public function counts scales without elements as absent: (0, 1) in grad_y's
        # dtype (test_finalize_grad_zero_tokens pins which front gives which)
        exp_gsc, mag_gsc, sdt = exp_gsc[:, :1], mag_gsc[:, :1], gy.dtype
    assert gsc.dtype == sdt, (gsc.dtype, sdt)
    assert_close_to_ref(gsc, exp_gsc, sdt, scale=mag_gsc, n_reduce=H, what="grad_scales")
    if case.get("scales") is None:  # D5
        assert tuple(gsc.shape) == (R, 1) and torch.all(gsc == 0)


def make_grad_case(rng, dtype, drop_pad_mode, R, K, H, E, C=None, scales=True, bias=True,
                   active_num=0, n_keep=None):
    n = R * K
    if drop_pad_mode == 0:
        rows = active_num if 0 < active_num < n else n
        ex = randn((rows, H), dtype, rng)
        idx = rand_perm_idx(n, rng)
        case = dict(active_num=active_num)
    else:
        C = C if C is not None else int(rng.integers(1, 6))
        ex = randn((E, C, H), dtype, rng)
        idx = rand_droppad_idx(n, E, C, rng, n_keep=n_keep)
        case = dict(expert_num=E, expert_capacity=C)
    case.update(grad_y=randn((R, H), dtype, rng), expanded_row_idx=idx,
                drop_pad_mode=drop_pad_mode)
    if scales:
        case["scales"] = randn((R, K), dtype, rng)
        case["expanded_x"] = ex
        if bias:
            case["bias"] = randn((E, H), dtype, rng)
            case["expert_idx"] = rand_expert_idx(R, K, E, rng, distinct=False)
    return case


@api_params
@pytest.mark.parametrize("active", ["none", "below", "equal", "above"])
@dtype_params
def test_finalize_grad_dropless_random_matches_reference(dtype, active, api, rng):
    R = int(rng.integers(1, 40))
    K = int(rng.integers(1, 5))
    H = int(rng.choice([1, 7, 16, 33, 257]))
    E = int(rng.integers(1, 9))
    n = R * K
    active_num = {"none": 0, "below": int(rng.integers(1, n)) if n > 1 else 0, "equal": n,
                  "above": n + int(rng.integers(1, 50))}[active]
    case = make_grad_case(rng, dtype, 0, R, K, H, E, bias=bool(rng.integers(0, 2)),
                          active_num=active_num)
    check_grad(run_grad(api, **case), **case)


@api_params
@dtype_params
def test_finalize_grad_active_num_truncation_keeps_bias_term(dtype, api, rng):
    # indices >= active_num: no grad_expanded_x row, grad_scales = bias . grad_y only
    R, K, H, E = 12, 4, 65, 5
    case = make_grad_case(rng, dtype, 0, R, K, H, E, active_num=R * K // 3)
    gex, gsc = run_grad(api, **case)
    assert tuple(gex.shape) == (R * K // 3, H)
    check_grad((gex, gsc), **case)


@api_params
@dtype_params
def test_finalize_grad_droppad_random_matches_reference(dtype, api, rng):
    R = int(rng.integers(1, 30))
    K = int(rng.integers(1, 5))
    H = int(rng.choice([1, 7, 16, 33, 257]))
    E = int(rng.integers(1, 9))
    case = make_grad_case(rng, dtype, 1, R, K, H, E, bias=bool(rng.integers(0, 2)))
    gex, gsc = run_grad(api, **case)
    assert tuple(gex.shape) == (E, case["expert_capacity"], H)
    check_grad((gex, gsc), **case)


@api_params
@dtype_params
def test_finalize_grad_droppad_empty_capacity_rows_zero_and_dropped_slots_bias_only(
        dtype, api, rng):
    R, K, H, E, C = 10, 2, 31, 4, 6  # 20 slots into 24 positions, only 7 kept
    for n_keep in (7, 0):
        case = make_grad_case(rng, dtype, 1, R, K, H, E, C=C, n_keep=n_keep)
        check_grad(run_grad(api, **case), **case)
        case.pop("bias")
        case.pop("expert_idx")
        check_grad(run_grad(api, **case), **case)  # dropped slots: grad_scales exactly 0


@api_params
@pytest.mark.parametrize("drop_pad_mode", [0, 1], ids=["dropless", "droppad"])
@dtype_params
def test_finalize_grad_without_scales_zero_grad_scales(dtype, drop_pad_mode, api, rng):
    # D5 / L6: K = 1, grad_expanded_x rows = grad_y rows, grad_scales (R, 1) zeros in grad_y
    # dtype, expanded_x not needed (bias/expert_idx ignored without scales)
    R, H, E = 15, 40, 4
    case = make_grad_case(rng, dtype, drop_pad_mode, R, 1, H, E, C=5, scales=False)
    check_grad(run_grad(api, **case), **case)


@api_params
@pytest.mark.parametrize("drop_pad_mode", [0, 1], ids=["dropless", "droppad"])
@dtype_params
def test_finalize_grad_zero_tokens(dtype, drop_pad_mode, api, rng):
    H, E, C, K = 16, 3, 2, 2
    case = make_grad_case(rng, dtype, drop_pad_mode, 0, K, H, E, C=C)
    gex, gsc = run_grad(api, **case)
    if drop_pad_mode == 0:
        assert tuple(gex.shape) == (0, H)
    else:  # D4: (E, C, H), all zeros
        assert tuple(gex.shape) == (E, C, H) and torch.all(gex == 0)
    if api == "public":  # scales (0, K) has no elements: absent, as the vendor's wrapper sizes it
        assert tuple(gsc.shape) == (0, 1) and gsc.dtype == dtype
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                    for k, v in case.items()}
            assert tuple(run_grad(api, **fake)[1].shape) == (0, 1)
    else:  # the C entry point writes the caller's buffer of the scales' shape
        assert tuple(gsc.shape) == (0, K)


@pytest.mark.parametrize("drop_pad_mode", [0, 1], ids=["dropless", "droppad"])
def test_finalize_grad_accepts_int64_indices_in_python(drop_pad_mode, rng):
    case = make_grad_case(rng, torch.float32, drop_pad_mode, 9, 3, 12, 4, C=4)
    case64 = dict(case)
    case64["expanded_row_idx"] = case["expanded_row_idx"].to(torch.int64)
    case64["expert_idx"] = case["expert_idx"].to(torch.int64)
    check_grad(run_grad("public", **case64), **case)


def test_finalize_grad_is_transpose_of_forward(rng):
    # <grad_y, F(ex, s)> derivative identity: for the row layout forward (mode 2) without bias,
    # sum(grad_ex * ex) == sum(grad_y * (out - x1)) and sum(grad_s * s) == the same.
    R, K, H = 9, 3, 20
    case = make_forward_case(rng, torch.float32, 2, R, K, H, 1, scales=True, bias=False,
                             x1=False)
    gy = randn((R, H), torch.float32, rng)
    out = moegrad.moe_finalize_routing(case["expanded_x"], case["expanded_row_idx"],
                                       scales=case["scales"], drop_pad_mode=2, k=K)
    gex, gsc = moegrad.moe_finalize_routing_grad(gy, case["expanded_row_idx"],
                                                 case["expanded_x"], case["scales"])
    lhs = float((gy.double() * out.double()).sum())
    a = float((gex.double() * case["expanded_x"].double()).sum())
    b = float((gsc.double() * case["scales"].double()).sum())
    scale = float((np.abs(ref.as_f64(gy)) * ref.finalize_routing_magnitude(
        case["expanded_x"], case["expanded_row_idx"], scales=case["scales"],
        drop_pad_mode=2)).sum())
    assert abs(a - lhs) <= 1e-5 * scale and abs(b - lhs) <= 1e-5 * scale, (a, b, lhs)


@pytest.mark.parametrize("drop_pad_mode", [0, 3], ids=["dropless_col", "droppad_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_finalize_forward_large_multithreaded(dtype, drop_pad_mode, three_threads, rng):
    case = make_forward_case(rng, dtype, drop_pad_mode, R=512, K=4, H=1024, E=16, C=96)
    check_forward(run_forward("lowlevel", **case), **case)


@pytest.mark.parametrize("drop_pad_mode", [0, 1], ids=["dropless", "droppad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_finalize_grad_large_multithreaded(dtype, drop_pad_mode, three_threads, rng):
    R, K = 512, 4
    case = make_grad_case(rng, dtype, drop_pad_mode, R, K, 1024, 16, C=96,
                          active_num=R * K - 300 if drop_pad_mode == 0 else 0)
    check_grad(run_grad("lowlevel", **case), **case)


@api_params
@dtype_params
def test_finalize_grad_ignores_bias_without_scales(dtype, api, rng):
    # §3.6: without scales, bias / expert_idx are not checked and ignored (K = 1)
    R, H, E = 9, 24, 3
    case = make_grad_case(rng, dtype, 0, R, 1, H, E, scales=False)
    with_bias = dict(case, bias=randn((E, H), dtype, rng),
                     expert_idx=rand_expert_idx(R, 1, E, rng))
    check_grad(run_grad(api, **with_bias), **case)
