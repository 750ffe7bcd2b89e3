"""MoeGatingTopK forward (§2, D13, L1, L2) and MoeGatingTopKBackward (§1, D1, D15) against the
float64 reference, through the public API and through moegrad._C with poisoned outputs."""

import math

import numpy as np
import pytest
import torch

import moegrad
import reference as ref
from conftest import (assert_close_to_ref, dtype_params, poison, rand_expert_idx, randn,
                      tie_free_gating_inputs)

APIS = ("public", "lowlevel")
api_params = pytest.mark.parametrize("api", APIS)


# ---------------------------------------------------------------------------------------------
# runners
# ---------------------------------------------------------------------------------------------
def run_forward(api, x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    if api == "public":
        return moegrad.moe_gating_top_k(
            x, k, bias=bias, k_group=k_group, group_count=group_count,
            group_select_mode=group_select_mode, renorm=renorm, norm_type=norm_type,
            out_flag=out_flag, routed_scaling_factor=routed_scaling_factor, eps=eps)
    M, N = x.shape
    y = poison(torch.empty((M, k), dtype=x.dtype))
    idx = poison(torch.empty((M, k), dtype=torch.int32))
    norm_out = poison(torch.empty((M, N), dtype=torch.float32))
    moegrad._C.moe_gating_top_k(x.contiguous(), bias, k, k_group, group_count, group_select_mode,
                                renorm, norm_type, out_flag, routed_scaling_factor, eps, y, idx,
                                norm_out)
    return y, idx, norm_out


def run_backward(api, x_norm, grad_y, expert_idx, renorm=0, norm_type=1,
                 routed_scaling_factor=1.0, eps=1e-20):
    if api == "public":
        return moegrad.moe_gating_top_k_backward(
            x_norm, grad_y, expert_idx, renorm=renorm, norm_type=norm_type,
            routed_scaling_factor=routed_scaling_factor, eps=eps)
    gx = poison(torch.empty(x_norm.shape, dtype=grad_y.dtype))
    moegrad._C.moe_gating_top_k_backward(x_norm, grad_y, expert_idx.to(torch.int32), renorm,
                                         norm_type, routed_scaling_factor, eps, gx)
    return gx


# ---------------------------------------------------------------------------------------------
# forward check
# ---------------------------------------------------------------------------------------------
def check_forward(out, x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                  norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20,
                  tie_free=True):
    """Compare (y, expert_idx, norm_out) with the reference.

    Rows without an fp32 near-tie (all rows when the inputs are tie-free) must give exactly the
    reference indices. Rows with a near-tie (only with non tie-free inputs) must pick experts
    whose scores equal the reference's within the near-tie width. y is compared with the
    reference weights of the indices actually chosen."""
    y, idx, norm_out = out
    M, N = x.shape
    assert y.dtype == x.dtype and tuple(y.shape) == (M, k), (y.dtype, y.shape)
    assert idx.dtype == torch.int32 and tuple(idx.shape) == (M, k), (idx.dtype, idx.shape)
    assert norm_out.dtype == torch.float32 and tuple(norm_out.shape) == (M, N)
    sel = dict(k_group=k_group, group_count=group_count, group_select_mode=group_select_mode,
               norm_type=norm_type)
    y_ref, idx_ref, norm_ref = ref.moe_gating_top_k(
        x, k, bias, renorm=renorm, out_flag=out_flag,
        routed_scaling_factor=routed_scaling_factor, eps=eps, **sel)
    amb = ref.gating_ambiguous_rows(x, k, bias, **sel)
    if tie_free:
        assert not amb.any(), "test inputs are not tie-free (test bug)"
    got = idx.numpy().astype(np.int64)
    clear = ~amb
    mism = np.argwhere(got[clear] != idx_ref[clear])
    assert mism.size == 0, (
        f"expert_idx differs from the reference in {len(np.unique(mism[:, 0]))} rows; first: "
        f"row {np.flatnonzero(clear)[mism[0, 0]]}: got {got[clear][mism[0, 0]]}, "
        f"expected {idx_ref[clear][mism[0, 0]]}")
    if amb.any():
        sc = ref.gating_scores(x, bias, **sel)
        for r in np.flatnonzero(amb):
            g = got[r]
            assert np.all((g >= 0) & (g < N)) and len(set(g.tolist())) == k, f"row {r}: {g}"
            if group_count > 1 and k_group < group_count:
                ng = N // group_count
                assert len(set((g // ng).tolist())) <= k_group, f"row {r}: too many groups {g}"
            else:
                a, b = sc["score"][r, g], sc["score"][r, idx_ref[r]]
                m = np.maximum(sc["mag"][r, g], sc["mag"][r, idx_ref[r]])
                ok = (np.abs(a - b) <= 1e-5 * m) | (np.isnan(a) & np.isnan(b))
                assert ok.all(), f"row {r}: picked {g} scores {a}, reference {idx_ref[r]} {b}"
    # weights at the chosen indices
    norm_full = ref.normalize(ref.as_f64(x), norm_type)
    y_exp = ref.gating_weights(norm_full, got, renorm, norm_type, routed_scaling_factor, eps)
    g = np.take_along_axis(norm_full, got, 1)
    renormed = norm_type in (1, 2) or renorm == 1
    n_red = N if norm_type == 0 else 1
    # sqrt-softplus of x < -87 goes through an fp32-subnormal softplus value (absolute error up
    # to 2^-150, i.e. up to ~1e-23 after the sqrt): give those scores an absolute error scale
    floor = 1e-17 if norm_type == 2 else 0.0
    norm_scale = np.maximum(np.abs(norm_full), floor)
    g_scale = np.take_along_axis(norm_scale, got, 1)
    if renormed:
        S = g.sum(1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            D = np.abs(S + ref.f32(eps))
            cond = 1.0 + (S + abs(ref.f32(eps))) / D
            scale = abs(ref.f32(routed_scaling_factor)) * g_scale / D * cond
        n_red += k
    else:
        scale = abs(ref.f32(routed_scaling_factor)) * g_scale
    assert_close_to_ref(y, y_exp, x.dtype, scale=scale, n_reduce=n_red, what="y")
    if out_flag:
        assert_close_to_ref(norm_out, norm_ref, torch.float32, scale=norm_scale, n_reduce=n_red,
                            what="norm_out")
    else:  # L1: zero-filled
        assert torch.all(norm_out == 0), "norm_out must be zero-filled when out_flag=False"


# ---------------------------------------------------------------------------------------------
# forward tests
# ---------------------------------------------------------------------------------------------
@api_params
@pytest.mark.parametrize("norm_type", [0, 1, 2], ids=["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("renorm", [0, 1])
@dtype_params
def test_gating_forward_random_tie_free_matches_reference(dtype, renorm, norm_type, api, rng):
    M = int(rng.integers(1, 40))
    N = int(rng.choice([2, 3, 8, 31, 64, 256]))
    k = int(rng.integers(1, N + 1))
    out_flag = bool(rng.integers(0, 2))
    rsf = float(rng.choice([1.0, 2.5, -1.5, 0.1]))
    x, _ = tie_free_gating_inputs(M, N, dtype, rng, k, norm_type)
    kw = dict(renorm=renorm, norm_type=norm_type, out_flag=out_flag, routed_scaling_factor=rsf)
    check_forward(run_forward(api, x, k, **kw), x, k, **kw)


@api_params
@pytest.mark.parametrize("N,k", [(1, 1), (2, 1), (2, 2), (16, 1), (16, 16), (257, 257)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("norm_type", [0, 1, 2], ids=["softmax", "sigmoid", "sqrtsoftplus"])
@dtype_params
def test_gating_forward_edge_k_and_n(dtype, norm_type, N, k, api, rng):
    if dtype == torch.bfloat16 and N > 256:
        N = k = 256
    x, _ = tie_free_gating_inputs(9, N, dtype, rng, k, norm_type)
    kw = dict(norm_type=norm_type, renorm=1, out_flag=True, routed_scaling_factor=1.0)
    check_forward(run_forward(api, x, k, **kw), x, k, **kw)


@pytest.mark.parametrize("norm_type", [0, 1, 2], ids=["softmax", "sigmoid", "sqrtsoftplus"])
@dtype_params
def test_gating_forward_n2048(dtype, norm_type, rng):
    N, k, M = 2048, int(rng.choice([1, 8, 64])), 6
    kw = dict(norm_type=norm_type, renorm=1, out_flag=True, routed_scaling_factor=2.5)
    if dtype == torch.bfloat16:
        # bf16 cannot hold 2048 well-separated logits: random logits, near-ties judged by score
        x = randn((M, N), dtype, rng, std=2.0)
        check_forward(run_forward("lowlevel", x, k, **kw), x, k, tie_free=False, **kw)
    else:
        x, _ = tie_free_gating_inputs(M, N, dtype, rng, k, norm_type)
        check_forward(run_forward("lowlevel", x, k, **kw), x, k, **kw)


@pytest.mark.parametrize("group_select_mode", [0, 1], ids=["max", "top2sum"])
@dtype_params
def test_gating_forward_n2048_group_limited(dtype, group_select_mode, rng):
    if dtype == torch.bfloat16:
        x = randn((6, 2048), dtype, rng, std=2.0)
        tie_free = False
    else:
        x, _ = tie_free_gating_inputs(6, 2048, dtype, rng, 8, 1, k_group=3, group_count=8,
                                      group_select_mode=group_select_mode)
        tie_free = True
    kw = dict(k_group=3, group_count=8, group_select_mode=group_select_mode, norm_type=1,
              out_flag=True)
    check_forward(run_forward("public", x, 8, **kw), x, 8, tie_free=tie_free, **kw)


@api_params
@dtype_params
def test_gating_forward_zero_tokens_gives_empty_outputs(dtype, api):
    x = torch.zeros((0, 16), dtype=dtype)
    y, idx, norm_out = run_forward(api, x, 4, norm_type=1, out_flag=True)
    assert tuple(y.shape) == (0, 4) and y.dtype == dtype
    assert tuple(idx.shape) == (0, 4) and idx.dtype == torch.int32
    assert tuple(norm_out.shape) == (0, 16) and norm_out.dtype == torch.float32


@api_params
@pytest.mark.parametrize("norm_type", [0, 1, 2], ids=["softmax", "sigmoid", "sqrtsoftplus"])
@dtype_params
def test_gating_forward_bias_used_for_selection_not_weights(dtype, norm_type, api, rng):
    M, N = int(rng.integers(1, 30)), int(rng.choice([4, 16, 64]))
    k = int(rng.integers(1, N + 1))
    x, bias = tie_free_gating_inputs(M, N, dtype, rng, k, norm_type, with_bias=True)
    kw = dict(norm_type=norm_type, renorm=int(rng.integers(0, 2)), out_flag=True,
              routed_scaling_factor=float(rng.choice([1.0, -0.7])))
    check_forward(run_forward(api, x, k, bias=bias, **kw), x, k, bias=bias, **kw)


def test_gating_forward_bias_changes_selection_but_weights_use_unbiased_scores():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    y, idx, norm = moegrad.moe_gating_top_k(x, 2, bias=bias, norm_type=1, out_flag=True,
                                            routed_scaling_factor=2.0, eps=0.0)
    assert idx.tolist() == [[0, 3]]
    s = torch.sigmoid(x[0].double())
    expected = 2.0 * torch.stack([s[0], s[3]]) / (s[0] + s[3])
    assert_close_to_ref(y, expected.numpy()[None], torch.float32)


@api_params
@pytest.mark.parametrize("group_select_mode", [0, 1], ids=["max", "top2sum"])
@pytest.mark.parametrize("norm_type", [0, 1, 2], ids=["softmax", "sigmoid", "sqrtsoftplus"])
@dtype_params
def test_gating_forward_group_limited_topk(dtype, norm_type, group_select_mode, api, rng):
    M = int(rng.integers(1, 24))
    group_count = int(rng.choice([2, 4, 8]))
    ng = int(rng.choice([2, 3, 8]))
    N = group_count * ng
    k_group = int(rng.integers(1, group_count + 1))
    k = int(rng.integers(1, k_group * ng + 1))
    with_bias = bool(rng.integers(0, 2))
    sel = dict(k_group=k_group, group_count=group_count, group_select_mode=group_select_mode)
    x, bias = tie_free_gating_inputs(M, N, dtype, rng, k, norm_type, with_bias=with_bias, **sel)
    kw = dict(norm_type=norm_type, renorm=1, out_flag=True, routed_scaling_factor=1.5, **sel)
    check_forward(run_forward(api, x, k, bias=bias, **kw), x, k, bias=bias, **kw)


@pytest.mark.parametrize("group_select_mode", [0, 1], ids=["max", "top2sum"])
def test_gating_forward_group_count_equal_n_and_k_group_equal_group_count(group_select_mode,
                                                                           rng):
    N = 12
    if group_select_mode == 0:  # group size 1
        x, _ = tie_free_gating_inputs(10, N, torch.float32, rng, 5, 1, k_group=7, group_count=N)
        kw = dict(k_group=7, group_count=N, norm_type=1)
        check_forward(run_forward("lowlevel", x, 5, **kw), x, 5, **kw)
    x, _ = tie_free_gating_inputs(10, N, torch.float32, rng, 5, 1, k_group=4, group_count=4,
                                  group_select_mode=group_select_mode)
    kw = dict(k_group=4, group_count=4, group_select_mode=group_select_mode, norm_type=1)
    y, idx, _ = run_forward("lowlevel", x, 5, **kw)
    check_forward((y, idx, _), x, 5, **kw)
    _, idx_plain, _ = run_forward("lowlevel", x, 5, norm_type=1)
    assert torch.equal(idx, idx_plain), "k_group == group_count must equal plain top-k"


@api_params
@pytest.mark.parametrize("norm_type", [0, 1, 2], ids=["softmax", "sigmoid", "sqrtsoftplus"])
@dtype_params
def test_gating_forward_equal_logits_go_to_lower_index(dtype, norm_type, api):
    x = torch.tensor([[0.5] * 8,
                      [1.0, 3.0, 3.0, 2.0, 3.0, -1.0, 3.0, 0.0],
                      [-2.0, -2.0, 4.0, -2.0, 4.0, -2.0, -2.0, -2.0]], dtype=dtype)
    y, idx, norm = run_forward(api, x, 5, norm_type=norm_type, renorm=1, out_flag=True)
    assert idx.tolist() == [[0, 1, 2, 3, 4], [1, 2, 4, 6, 3], [2, 4, 0, 1, 3]]
    check_forward((y, idx, norm), x, 5, norm_type=norm_type, renorm=1, out_flag=True)


@api_params
@dtype_params
def test_gating_forward_equal_scores_with_bias_go_to_lower_index(dtype, api):
    # score = sigmoid(x) + bias, equal for experts 1, 3 and 5 (same x, same bias)
    x = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]], dtype=dtype)
    bias = torch.tensor([0.0, 0.5, 0.25, 0.5, -1.0, 0.5], dtype=dtype)
    y, idx, norm = run_forward(api, x, 4, bias=bias, norm_type=1, out_flag=True)
    assert idx.tolist() == [[1, 3, 5, 2]]
    check_forward((y, idx, norm), x, 4, bias=bias, norm_type=1, out_flag=True)


@api_params
@pytest.mark.parametrize("group_select_mode", [0, 1], ids=["max", "top2sum"])
@dtype_params
def test_gating_forward_equal_group_scores_keep_lower_group(dtype, group_select_mode, api):
    # 4 groups of 2; groups 1, 2 and 3 have identical contents (tie), group 0 is lower.
    x = torch.tensor([[-3.0, -3.0, 2.0, 1.0, 1.0, 2.0, 2.0, 1.0]], dtype=dtype)
    kw = dict(k_group=2, group_count=4, group_select_mode=group_select_mode, norm_type=1)
    y, idx, norm = run_forward(api, x, 3, **kw)
    assert idx.tolist() == [[2, 5, 3]]  # groups 1 and 2 kept; equal scores 2 -> 5 -> 3 -> 4
    check_forward((y, idx, norm), x, 3, **kw)


@api_params
@dtype_params
def test_gating_forward_nan_logits_rank_above_all_numbers(dtype, api):
    nan = float("nan")
    x = torch.tensor([[0.0, nan, 5.0, nan, 1.0, 100.0],
                      [3.0, 2.0, 1.0, 0.0, -1.0, nan]], dtype=dtype)
    y, idx, norm = run_forward(api, x, 4, norm_type=1, out_flag=True)
    assert idx.tolist() == [[1, 3, 5, 2], [5, 0, 1, 2]]
    assert torch.isnan(y).all(), "renormalised weights of a row with a NaN pick are NaN"
    check_forward((y, idx, norm), x, 4, norm_type=1, out_flag=True)


@api_params
@dtype_params
def test_gating_forward_softmax_row_with_nan_is_all_nan_and_lowest_indices(dtype, api):
    nan = float("nan")
    x = torch.tensor([[0.0, 1.0, nan, 3.0, 2.0], [0.0, 1.0, 4.0, 3.0, 2.0]], dtype=dtype)
    y, idx, norm = run_forward(api, x, 3, norm_type=0, out_flag=True)
    assert idx.tolist() == [[0, 1, 2], [2, 3, 4]]
    check_forward((y, idx, norm), x, 3, norm_type=0, out_flag=True)


@api_params
@pytest.mark.parametrize("norm_type", [0, 1, 2], ids=["softmax", "sigmoid", "sqrtsoftplus"])
@dtype_params
def test_gating_forward_extreme_logits_give_no_nan(dtype, norm_type, api):
    # x = +100 / +1000 overflow a naive exp(x) / (1 + exp(x)); -100 / -1000 are the two lowest
    # scores and stay unselected (their order depends on fp32 subnormal handling).
    # sigmoid(30) is 1 - 9e-14 in float64 but 1.0 in fp32: a near tie, hence tie_free=False.
    x = torch.tensor([[1000.0, -1000.0, 100.0, -100.0, 0.5, 0.0, -30.0, 30.0]], dtype=dtype)
    y, idx, norm = run_forward(api, x, 6, norm_type=norm_type, renorm=1, out_flag=True)
    assert not torch.isnan(y).any() and not torch.isnan(norm).any()
    check_forward((y, idx, norm), x, 6, norm_type=norm_type, renorm=1, out_flag=True,
                  tie_free=False)
    if norm_type == 1:  # stable sigmoid: exact limits
        assert norm[0, 0] == 1.0 and norm[0, 2] == 1.0 and norm[0, 1] == 0.0
        assert 0.0 <= norm[0, 3] < 1e-40
    if norm_type == 2:
        assert abs(norm[0, 0].item() - math.sqrt(1000.0)) < 1e-3 and norm[0, 1] == 0.0


@api_params
@dtype_params
def test_gating_forward_negative_eps_and_negative_scaling_factor(dtype, api, rng):
    # sigmoid scores of x >= 2 are > 0.88, so sum(g) + eps stays far from 0 with eps = -0.6
    M, N, k = 12, 16, 3
    x, _ = tie_free_gating_inputs(M, N, dtype, rng, k, 1)
    x = x.abs() + 2.0
    x = x.to(dtype)
    for eps, rsf in [(-0.6, -1.5), (1e-10, -33.48), (0.0, 0.25)]:
        kw = dict(norm_type=1, routed_scaling_factor=rsf, eps=eps, out_flag=False)
        check_forward(run_forward(api, x, k, **kw), x, k, tie_free=False, **kw)


@dtype_params
def test_gating_forward_lowlevel_writes_every_output_element(dtype, rng):
    # poisoned buffers (NaN / 0xFF) must all be overwritten, incl. norm_out with out_flag False
    x, _ = tie_free_gating_inputs(17, 32, dtype, rng, 5, 0)
    y, idx, norm = run_forward("lowlevel", x, 5, norm_type=0, out_flag=False)
    assert not torch.isnan(y).any() and torch.all((idx >= 0) & (idx < 32))
    assert torch.all(norm == 0)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
def make_x_norm(M, N, rng, saturate=True):
    xn = rng.uniform(0.0, 1.0, (M, N))
    if saturate and M * N >= 4:  # some exact 0 / 1 scores: their gradient must be exactly 0
        flat = xn.reshape(-1)
        pos = rng.choice(flat.size, max(1, flat.size // 10), replace=False)
        flat[pos] = rng.integers(0, 2, pos.size).astype(np.float64)
    return torch.from_numpy(xn).to(torch.float32)


def check_backward(gx, xn, gy, e, rsf, eps):
    assert gx.dtype == gy.dtype and tuple(gx.shape) == tuple(xn.shape), (gx.dtype, gx.shape)
    expected = ref.moe_gating_top_k_backward(xn, gy, e, routed_scaling_factor=rsf, eps=eps)
    mag = ref.gating_backward_magnitude(xn, gy, e, routed_scaling_factor=rsf, eps=eps)
    assert_close_to_ref(gx, expected, gy.dtype, scale=mag, n_reduce=gy.shape[1] + 1,
                        what="grad_x")
    # non-selected experts and saturated scores: exactly zero
    sel = np.zeros(tuple(xn.shape), dtype=bool)
    if xn.shape[0]:
        np.put_along_axis(sel, e.numpy().astype(np.int64), True, 1)
    xnn = xn.numpy()
    zero = ~sel | (xnn == 0.0) | (xnn == 1.0)
    assert torch.all(gx[torch.from_numpy(zero)] == 0), "grad_x must be exactly 0 there"


@api_params
@dtype_params
def test_gating_backward_random_matches_reference(dtype, api, rng):
    M = int(rng.integers(1, 50))
    N = int(rng.choice([2, 3, 9, 64, 255]))
    K = int(rng.integers(1, N + 1))
    xn = make_x_norm(M, N, rng)
    gy = randn((M, K), dtype, rng)
    e = rand_expert_idx(M, K, N, rng)
    rsf = float(rng.choice([1.0, 2.5, 0.1, -1.3]))
    eps = float(rng.choice([1e-20, 1e-10]))
    gx = run_backward(api, xn, gy, e, routed_scaling_factor=rsf, eps=eps)
    check_backward(gx, xn, gy, e, rsf, eps)


@api_params
@pytest.mark.parametrize("N,K", [(2, 1), (2, 2), (2048, 1), (2048, 64), (2048, 2048)],
                         ids=lambda v: str(v))
@dtype_params
def test_gating_backward_edge_sizes(dtype, N, K, api, rng):
    M = 3
    xn = make_x_norm(M, N, rng)
    gy = randn((M, K), dtype, rng)
    e = rand_expert_idx(M, K, N, rng)
    gx = run_backward(api, xn, gy, e, routed_scaling_factor=1.7)
    check_backward(gx, xn, gy, e, 1.7, 1e-20)


@api_params
@dtype_params
def test_gating_backward_zero_tokens(dtype, api):
    xn = torch.zeros((0, 8), dtype=torch.float32)
    gx = run_backward(api, xn, torch.zeros((0, 2), dtype=dtype),
                      torch.zeros((0, 2), dtype=torch.int32))
    assert tuple(gx.shape) == (0, 8) and gx.dtype == dtype


@api_params
@dtype_params
def test_gating_backward_repeated_expert_ids_scatter_add(dtype, api, rng):
    M, N, K = 6, 5, 4
    xn = make_x_norm(M, N, rng, saturate=False)
    gy = randn((M, K), dtype, rng)
    e = rand_expert_idx(M, K, N, rng, distinct=False)
    e[0] = torch.tensor([2, 2, 2, 4], dtype=torch.int32)
    gx = run_backward(api, xn, gy, e, routed_scaling_factor=0.9)
    check_backward(gx, xn, gy, e, 0.9, 1e-20)


@dtype_params
def test_gating_backward_accepts_int64_expert_idx_in_python(dtype, rng):
    xn = make_x_norm(7, 12, rng)
    gy = randn((7, 3), dtype, rng)
    e = rand_expert_idx(7, 3, 12, rng, dtype=torch.int64)
    gx = moegrad.moe_gating_top_k_backward(xn, gy, e, routed_scaling_factor=2.0)
    check_backward(gx, xn, gy, e, 2.0, 1e-20)


@dtype_params
def test_gating_backward_of_forward_sigmoid_output_matches_reference(dtype, rng):
    # chain forward (out_flag, sigmoid) -> backward with a random upstream gradient
    M, N, k = 20, 32, 6
    x, _ = tie_free_gating_inputs(M, N, dtype, rng, k, 1)
    y, idx, norm = moegrad.moe_gating_top_k(x, k, norm_type=1, out_flag=True,
                                            routed_scaling_factor=2.5)
    gy = randn((M, k), dtype, rng)
    gx = moegrad.moe_gating_top_k_backward(norm, gy, idx, routed_scaling_factor=2.5)
    check_backward(gx, norm, gy, idx, 2.5, 1e-20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gating_forward_and_backward_large_batch_multithreaded(dtype, three_threads, rng):
    # sizes large enough for the kernels to split rows across threads
    M, N, k = 1024, 256, 8
    sel = dict(k_group=4, group_count=8, group_select_mode=1)
    x, bias = tie_free_gating_inputs(M, N, dtype, rng, k, 1, with_bias=dtype == torch.float32,
                                     **sel)
    kw = dict(norm_type=1, out_flag=True, routed_scaling_factor=2.5, **sel)
    y, idx, norm = run_forward("public", x, k, bias=bias, **kw)
    check_forward((y, idx, norm), x, k, bias=bias, **kw)
    gy = randn((M, k), dtype, rng)
    gx = run_backward("lowlevel", norm, gy, idx, routed_scaling_factor=2.5)
    check_backward(gx, norm, gy, idx, 2.5, 1e-20)


@api_params
@pytest.mark.parametrize("group_select_mode", [0, 1], ids=["max", "top2sum"])
@dtype_params
def test_gating_forward_nan_makes_its_group_rank_first(dtype, group_select_mode, api):
    # L2: group ranking uses the same order, so a group whose score is NaN (its max / top-2 sum
    # under the NaN-first order) is kept before every numeric group score
    nan = float("nan")
    x = torch.tensor([[3.0, 2.0, -4.0, nan, 1.0, 0.5, 2.5, -1.0]], dtype=dtype)
    kw = dict(k_group=2, group_count=4, group_select_mode=group_select_mode, norm_type=1,
              out_flag=True)
    y, idx, norm = run_forward(api, x, 3, **kw)
    assert idx.tolist() == [[3, 0, 1]], idx.tolist()  # groups 1 (NaN) and 0 kept
    check_forward((y, idx, norm), x, 3, **kw)


@api_params
@dtype_params
def test_gating_forward_infinite_logits_sigmoid(dtype, api):
    # L11: +-inf follow the formula: sigmoid(+inf) = 1, sigmoid(-inf) = 0
    inf = float("inf")
    x = torch.tensor([[0.0, -inf, inf, 1.0, -2.0]], dtype=dtype)
    y, idx, norm = run_forward(api, x, 3, norm_type=1, out_flag=True)
    assert idx.tolist() == [[2, 3, 0]]
    assert norm[0, 2] == 1.0 and norm[0, 1] == 0.0
    check_forward((y, idx, norm), x, 3, norm_type=1, out_flag=True)


@api_params
@dtype_params
def test_gating_forward_all_zero_scores_nan_only_with_zero_eps(dtype, api):
    # D12: sigmoid(-1000) = 0 exactly; renormalising zeros gives 0 / (0 + eps): 0 with the
    # default eps, NaN with eps = 0 (documented)
    x = torch.full((2, 4), -1000.0, dtype=dtype)
    y, idx, _ = run_forward(api, x, 2, norm_type=1)
    assert idx.tolist() == [[0, 1], [0, 1]] and torch.all(y == 0)
    y, _, _ = run_forward(api, x, 2, norm_type=1, eps=0.0)
    assert torch.isnan(y).all()


def _selection_reference(scores, k, k_group, group_count, group_select_mode):
    """Expert ids of one row from its fp32 selection scores: larger first, equal scores (-0 ==
    +0) by lower index; with groups, each group's score is the fp32 sum of its best one or two
    scores and the k_group best groups (equal: lower group) hold the candidates."""
    n = len(scores)
    order = lambda ids: sorted(ids, key=lambda j: (-float(scores[j]), j))  # noqa: E731
    cand = range(n)
    if group_count > 1:
        gsize, take = n // group_count, 1 if group_select_mode == 0 else 2
        gscore = []
        for g in range(group_count):
            best = order(range(g * gsize, (g + 1) * gsize))[:take]
            s = np.float32(0.0)
            for j in best:
                s = np.float32(s + scores[j])
            gscore.append(s)
        kept = sorted(range(group_count), key=lambda g: (-float(gscore[g]), g))[:k_group]
        cand = [j for g in kept for j in range(g * gsize, (g + 1) * gsize)]
    return order(cand)[:k]


@pytest.mark.parametrize("N,k,group_count,k_group",
                         [(13, 1, 1, 1), (13, 8, 1, 1), (37, 3, 1, 1), (37, 9, 1, 1),
                          (64, 4, 1, 1), (300, 8, 1, 1), (300, 12, 1, 1), (256, 8, 8, 4),
                          (256, 9, 8, 4), (48, 5, 4, 2), (40, 2, 8, 1)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("group_select_mode", [0, 1], ids=["max", "top2sum"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_gating_forward_selection_with_many_exact_ties(N, k, group_count, k_group,
                                                       group_select_mode, with_bias, rng):
    # Logits and bias from a handful of values (and -0.0 next to +0.0): most rows hold many equal
    # scores, so every selection path (small k by repeated maxima, larger k by insertion) must
    # order them by index. Scores are read back from norm_out (checked against float64 elsewhere).
    M = 24
    x = torch.from_numpy(rng.choice(np.float32([-1.0, -0.0, 0.0, 0.5, 2.0]), size=(M, N)))
    bias = (torch.from_numpy(rng.choice(np.float32([0.0, 0.25, -0.25]), size=N))
            if with_bias else None)
    kw = dict(bias=bias, k_group=k_group, group_count=group_count,
              group_select_mode=group_select_mode, norm_type=1, out_flag=True)
    for api in APIS:
        y, idx, norm = run_forward(api, x, k, **kw)
        sel = norm.numpy() + (bias.numpy() if with_bias else np.float32(0.0))
        want = [_selection_reference(sel[r], k, k_group, group_count, group_select_mode)
                for r in range(M)]
        assert idx.tolist() == want, api


def _saved(fn):
    """(shape, dtype) of every tensor autograd saves while fn runs."""
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), t.dtype))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_autograd_keeps_one_score_sized_tensor(dtype, rng):
    """The gating autograd keeps the scores (out_flag) or the logits to recompute them, never
    both, and the ids; the replay keeps its scores and the ids, in the same layout (an
    activation checkpoint that replays the ids sees the same saved tensors; fp32 logits)."""
    M, N, K = 12, 16, 4
    x = randn((M, N), dtype, rng).requires_grad_(True)
    for out_flag, kept in ((False, ((M, N), dtype)), (True, ((M, N), torch.float32))):
        saved = _saved(lambda: moegrad.moe_gating_top_k(x, K, norm_type=0, renorm=1,
                                                        out_flag=out_flag))
        assert saved == [kept, ((M, K), torch.int32)], (out_flag, saved)
    idx = moegrad.moe_gating_top_k(x.detach(), K)[1]
    saved = _saved(lambda: moegrad.moe_gating_replay(x, idx, renorm=1))
    assert saved == [((M, N), torch.float32), ((M, K), torch.int32)], saved
    # and the gradients still reach x through both, as the float64 formula's
    g = randn((M, K), dtype, rng)
    for out_flag in (False, True):
        x.grad = None
        y = moegrad.moe_gating_top_k(x, K, norm_type=0, renorm=1, out_flag=out_flag)[0]
        y.backward(g)
        xr = x.detach().double().requires_grad_(True)
        p = torch.softmax(xr, -1)
        top = torch.gather(p, 1, idx.long())
        (top / top.sum(-1, keepdim=True)).backward(g.double())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(x.grad.double(), xr.grad, rtol=tol, atol=tol), out_flag
