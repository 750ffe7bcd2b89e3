"""The CUDA backend (docs/cuda.md): every operator on CUDA tensors against the float64 reference
and against the CPU backend, edge sizes, misaligned views, invalid device indices, bitwise
repeatability, CUDA-graph capture, torch.compile and opcheck, strict index mode and the demo.

Skipped as a whole without a CUDA device (torch.cuda.is_available() is False). On a CPU-only
build with a GPU present the tests fail: a CUDA build is what they test."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import moegrad
import reference as ref
from conftest import (assert_close_to_ref, dtype_params, poison, rand_droppad_idx,
                      rand_expert_idx, rand_perm_idx, randn, tie_free_gating_inputs, tolerance)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available())")

DEV = "cuda"


def cu(t):
    return None if t is None else t.to(DEV)


def host(t):
    return None if t is None else t.detach().cpu()


def bitwise_equal(a, b):
    a, b = host(a), host(b)
    if a.dtype.is_floating_point:
        return torch.equal(a.view(torch.uint8) if a.numel() else a,
                           b.view(torch.uint8) if b.numel() else b)
    return torch.equal(a, b)


def assert_close_to_cpu(got, cpu, dtype, scale=None, n_reduce=1, what="output"):
    """CUDA against CPU where the two may round differently: each lies within the tolerance of
    the exact value, so they differ by at most twice that (one output ulp for the two
    narrowings plus twice the fp32 term). NaN where the CPU has NaN, and only there."""
    g, c = ref.as_f64(host(got)), ref.as_f64(cpu)
    assert g.shape == c.shape, f"{what}: shape {g.shape} != {c.shape}"
    assert np.array_equal(np.isnan(g), np.isnan(c)), f"{what}: NaN positions differ from the CPU"
    fin = np.isfinite(g) & np.isfinite(c)
    assert np.array_equal(g[~fin & ~np.isnan(g)], c[~fin & ~np.isnan(c)]), f"{what}: inf differs"
    sc = None if scale is None else np.broadcast_to(np.asarray(scale, np.float64), c.shape)
    tol = 2 * tolerance(dtype, np.abs(c), sc, n_reduce, out_abs=np.where(fin, g, 0.0))
    err = np.where(fin, np.abs(g - c), 0.0)
    bad = err > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {g.size} elements differ from the CPU "
                           f"beyond twice the tolerance, e.g. at {np.argwhere(bad)[:3].tolist()}")


def misaligned(t):
    """A contiguous copy of t whose data pointer is one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    v = flat[1:].view(t.shape)
    v.copy_(t)
    assert v.data_ptr() % 16 != 0
    return v


def test_build_has_cuda():
    assert moegrad._C.cuda_built, "moegrad was built without the CUDA backend"


# ---------------------------------------------------------------------------------------------
# gating top-k forward
# ---------------------------------------------------------------------------------------------
GATING_CASES = [
    # M, N, k, norm_type, group_count, k_group, group_select_mode, bias
    (37, 8, 2, 1, 1, 1, 0, True),
    (64, 256, 8, 1, 8, 4, 1, True),      # DeepSeek-V3 style
    (33, 128, 8, 0, 1, 1, 0, False),     # Qwen3 style softmax
    (17, 32, 4, 2, 4, 2, 0, True),
    (9, 2, 1, 0, 1, 1, 0, False),        # N=2, K=1
    (5, 16, 16, 1, 1, 1, 0, False),      # K=N
    (0, 64, 4, 1, 1, 1, 0, False),       # zero tokens
]


@pytest.mark.parametrize("case", GATING_CASES, ids=lambda c: f"M{c[0]}N{c[1]}k{c[2]}nt{c[3]}g{c[4]}")
@dtype_params
def test_gating_forward_matches_reference_and_cpu(case, dtype, rng):
    M, N, k, nt, G, kg, gsm, with_bias = case
    if dtype == torch.bfloat16 and N > 256:
        pytest.skip("tie-free bf16 logits support N <= 256")
    x, bias = tie_free_gating_inputs(M, N, dtype, rng, k, norm_type=nt, with_bias=with_bias,
                                     k_group=kg, group_count=G, group_select_mode=gsm)
    kw = dict(bias=bias, k_group=kg, group_count=G, group_select_mode=gsm, renorm=1,
              norm_type=nt, out_flag=True, routed_scaling_factor=2.5)
    y, idx, norm = moegrad.moe_gating_top_k(cu(x), k, **{**kw, "bias": cu(bias)})
    assert y.device.type == DEV and idx.dtype == torch.int32
    ey, eidx, enorm = ref.moe_gating_top_k(x, k, **kw)
    assert np.array_equal(host(idx).numpy(), eidx), "expert_idx differs from the reference"
    assert_close_to_ref(host(y), ey, dtype, n_reduce=k, what="y")
    assert_close_to_ref(host(norm), enorm, torch.float32, n_reduce=N, what="norm_out")
    cy, cidx, cnorm = moegrad.moe_gating_top_k(x, k, **kw)
    assert torch.equal(host(idx), cidx), "CUDA and CPU choose different experts"
    assert_close_to_cpu(y, cy, dtype, n_reduce=k, what="y vs CPU")


def test_gating_forward_large_n_and_zero_norm_out(rng):
    M, N, k = 6, 2048, 8
    x, _ = tie_free_gating_inputs(M, N, torch.float32, rng, k, norm_type=1)
    y, idx, norm = moegrad.moe_gating_top_k(cu(x), k, norm_type=1)
    _, eidx, _ = ref.moe_gating_top_k(x, k, norm_type=1)
    assert np.array_equal(host(idx).numpy(), eidx)
    assert torch.count_nonzero(host(norm)) == 0  # out_flag False: zeros (L1)


def test_gating_forward_ties_go_to_lower_index():
    x = torch.zeros(4, 64, device=DEV)
    _, idx, _ = moegrad.moe_gating_top_k(x, 5, norm_type=1)
    assert host(idx).tolist() == [[0, 1, 2, 3, 4]] * 4


# ---------------------------------------------------------------------------------------------
# gating top-k backward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M,N,K", [(40, 256, 8), (7, 2, 1), (5, 2, 2), (3, 2048, 8), (0, 16, 4),
                                   (11, 32, 32), (4, 64, 40)])
@dtype_params
def test_gating_backward_sigmoid_matches_reference_and_cpu(M, N, K, dtype, rng):
    xn = torch.sigmoid(randn((M, N), torch.float32, rng))
    gy = randn((M, K), dtype, rng)
    e = rand_expert_idx(M, K, N, rng, distinct=False)  # repeats are summed (D1)
    gx = moegrad.moe_gating_top_k_backward(cu(xn), cu(gy), cu(e), routed_scaling_factor=1.5)
    exp = ref.moe_gating_top_k_backward(xn, gy, e, routed_scaling_factor=1.5)
    mag = ref.gating_backward_magnitude(xn, gy, e, routed_scaling_factor=1.5)
    assert_close_to_ref(host(gx), exp, dtype, scale=mag, n_reduce=K, what="grad_x")
    cgx = moegrad.moe_gating_top_k_backward(xn, gy, e, routed_scaling_factor=1.5)
    # Same operations in the same order as the CPU kernel: identical bits.
    assert bitwise_equal(gx, cgx)


@pytest.mark.parametrize("norm_type,renorm", [(0, 0), (0, 1), (2, 0)])
@pytest.mark.parametrize("M,N,K", [(40, 256, 8), (7, 2, 1), (3, 2048, 8), (0, 16, 4), (4, 64, 40)])
@dtype_params
def test_gating_backward_softmax_and_softplus_match_cpu(norm_type, renorm, M, N, K, dtype, rng):
    logits = randn((M, N), torch.float32, rng)
    if norm_type == 0:
        xn = torch.softmax(logits, dim=1)
    else:
        xn = torch.sqrt(torch.nn.functional.softplus(logits))
    gy = randn((M, K), dtype, rng)
    e = rand_expert_idx(M, K, N, rng, distinct=False)
    kw = dict(renorm=renorm, norm_type=norm_type, routed_scaling_factor=2.5)
    gx = moegrad.moe_gating_top_k_backward(cu(xn), cu(gy), cu(e), **kw)
    cgx = moegrad.moe_gating_top_k_backward(xn, gy, e, **kw)
    if norm_type == 0:
        assert bitwise_equal(gx, cgx)  # arithmetic only, in the CPU's order
    else:  # expm1 may round differently
        mag = np.abs(ref.as_f64(cgx)) + 1e-6 * np.abs(ref.as_f64(gy)).max(initial=0.0)
        assert_close_to_cpu(gx, cgx, dtype, scale=mag, n_reduce=K, what="grad_x vs CPU")


def test_gating_backward_invalid_device_indices_are_skipped(rng):
    M, N, K = 8, 16, 4
    xn = torch.sigmoid(randn((M, N), torch.float32, rng))
    gy = randn((M, K), torch.float32, rng)
    e = rand_expert_idx(M, K, N, rng)
    bad = e.clone()
    bad[:, 1] = torch.tensor([-1, N, 2**31 - 1, -(2**31), N + 5, -7, 99, N])
    gx = moegrad.moe_gating_top_k_backward(cu(xn), cu(gy), cu(bad))
    torch.cuda.synchronize()
    assert torch.isfinite(host(gx)).all()


# ---------------------------------------------------------------------------------------------
# finalize routing forward
# ---------------------------------------------------------------------------------------------
def finalize_case(rng, dtype, mode, R, K, H, E=6, C=None):
    droppad = mode in (1, 3)
    if droppad:
        C = C or 4
        ex = randn((E, C, H), dtype, rng)
        idx = rand_droppad_idx(R * K, E, C, rng)
    else:
        ex = randn((R * K, H), dtype, rng)
        idx = rand_perm_idx(R * K, rng)
    return dict(expanded_x=ex, expanded_row_idx=idx, x1=randn((R, H), dtype, rng),
                x2=randn((R, H), dtype, rng), bias=randn((E, H), dtype, rng),
                scales=randn((R, K), dtype, rng),
                expert_idx=rand_expert_idx(R, K, E, rng, distinct=False))


def run_finalize(case, mode, K, dev):
    c = {n: (cu(t) if dev == DEV else t) for n, t in case.items()}
    return moegrad.moe_finalize_routing(c["expanded_x"], c["expanded_row_idx"], x1=c["x1"],
                                        x2=c["x2"], bias=c["bias"], scales=c["scales"],
                                        expert_idx=c["expert_idx"], drop_pad_mode=mode, k=K)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("R,K,H", [(33, 4, 256), (5, 1, 1), (7, 8, 257), (3, 2, 259), (0, 2, 64),
                                   (4, 3, 2880)])
@dtype_params
def test_finalize_forward_matches_reference_and_cpu(mode, R, K, H, dtype, rng):
    case = finalize_case(rng, dtype, mode, R, K, H)
    out = run_finalize(case, mode, K, DEV)
    kw = dict(case, drop_pad_mode=mode, R=R, K=K)
    ex = kw.pop("expanded_x")
    ei = kw.pop("expanded_row_idx")
    exp = ref.moe_finalize_routing(ex, ei, **kw)
    mag = ref.finalize_routing_magnitude(ex, ei, **kw)
    assert_close_to_ref(host(out), exp, dtype, scale=mag, n_reduce=K + 2, what="out")
    # Same fp32 operations in the same order as the CPU kernel (no FMA contraction): same bits.
    assert bitwise_equal(out, run_finalize(case, mode, K, "cpu"))


@dtype_params
def test_finalize_forward_misaligned_views(dtype, rng):
    R, K, H = 9, 2, 64
    case = finalize_case(rng, dtype, 0, R, K, H)
    aligned = run_finalize(case, 0, K, DEV)
    c = {n: cu(t) for n, t in case.items()}
    for name in ("expanded_x", "x1", "bias"):
        c[name] = misaligned(c[name])
    out = moegrad.moe_finalize_routing(c["expanded_x"], c["expanded_row_idx"], x1=c["x1"],
                                       x2=c["x2"], bias=c["bias"], scales=c["scales"],
                                       expert_idx=c["expert_idx"], drop_pad_mode=0, k=K)
    assert bitwise_equal(out, aligned)


def test_finalize_forward_invalid_device_indices_are_skipped(rng):
    R, K, H, E = 6, 2, 32, 4
    case = finalize_case(rng, torch.float32, 0, R, K, H, E=E)
    case["expanded_row_idx"][:4] = torch.tensor([-5, R * K, 2**31 - 1, -(2**31)])
    case["expert_idx"][0] = torch.tensor([E, -1])
    out = run_finalize(case, 0, K, DEV)
    torch.cuda.synchronize()
    assert torch.isfinite(host(out)).all()


# ---------------------------------------------------------------------------------------------
# finalize routing grad
# ---------------------------------------------------------------------------------------------
def grad_case(rng, dtype, mode, R, K, H, E=5, C=4, active_num=0, scales=True, bias=True):
    gy = randn((R, H), dtype, rng)
    if mode == 1:
        idx = rand_droppad_idx(R * K, E, C, rng)
        ex = randn((E, C, H), dtype, rng)
    else:
        idx = rand_perm_idx(R * K, rng)
        rows = active_num if 0 < active_num < R * K else R * K
        ex = randn((rows, H), dtype, rng)
    c = dict(grad_y=gy, expanded_row_idx=idx)
    if scales:
        c.update(expanded_x=ex, scales=randn((R, K), torch.float32, rng))
        if bias:
            c.update(bias=randn((E, H), dtype, rng),
                     expert_idx=rand_expert_idx(R, K, E, rng, distinct=False))
    attrs = dict(drop_pad_mode=mode, active_num=active_num,
                 expert_num=E if mode == 1 else 0, expert_capacity=C if mode == 1 else 0)
    return c, attrs


def run_grad(c, attrs, dev):
    cc = {n: (cu(t) if dev == DEV else t) for n, t in c.items()}
    return moegrad.moe_finalize_routing_grad(cc.pop("grad_y"), cc.pop("expanded_row_idx"),
                                             **cc, **attrs)


@pytest.mark.parametrize("mode,active_num", [(0, 0), (0, 7), (1, 0)])
@pytest.mark.parametrize("R,K,H", [(21, 4, 256), (6, 1, 1), (5, 3, 257), (4, 2, 259), (0, 2, 8)])
@pytest.mark.parametrize("with_scales", [True, False])
@dtype_params
def test_finalize_grad_matches_reference_and_cpu(mode, active_num, R, K, H, with_scales, dtype,
                                                 rng):
    if not with_scales:
        K = 1
    c, attrs = grad_case(rng, dtype, mode, R, K, H, active_num=active_num, scales=with_scales)
    gex, gs = run_grad(c, attrs, DEV)
    eg, es = ref.moe_finalize_routing_grad(**c, **attrs)
    mg, ms = ref.moe_finalize_routing_grad(**c, **attrs, _abs=True)
    assert_close_to_ref(host(gex), eg, dtype, scale=mg, what="grad_expanded_x")
    assert_close_to_ref(host(gs), es, gs.dtype, scale=ms, n_reduce=H, what="grad_scales")
    cgex, cgs = run_grad(c, attrs, "cpu")
    assert bitwise_equal(gex, cgex), "grad_expanded_x: CUDA and CPU bits differ"
    assert_close_to_cpu(gs, cgs, gs.dtype, scale=ms, n_reduce=H, what="grad_scales vs CPU")


def test_finalize_grad_uncovered_rows_zeroed_in_poisoned_output(rng):
    R, K, H, E, C = 8, 2, 24, 6, 5
    c, attrs = grad_case(rng, torch.bfloat16, 1, R, K, H, E=E, C=C)
    gy, idx = cu(c["grad_y"]), cu(c["expanded_row_idx"])
    gex = poison(torch.empty((E, C, H), dtype=torch.bfloat16, device=DEV))
    gs = poison(torch.empty((R, K), dtype=torch.float32, device=DEV))
    moegrad._C.moe_finalize_routing_grad(gy, idx, cu(c["expanded_x"]), cu(c["scales"]),
                                         cu(c["expert_idx"]), cu(c["bias"]), 1, 0, E, C, gex, gs)
    eg, _ = ref.moe_finalize_routing_grad(**c, **attrs)
    assert_close_to_ref(host(gex), eg, torch.bfloat16, what="grad_expanded_x")


def test_finalize_grad_repeated_and_invalid_device_indices(rng):
    R, K, H = 6, 2, 40
    c, attrs = grad_case(rng, torch.float32, 0, R, K, H)
    c["expanded_row_idx"][:3] = torch.tensor([3, 3, 2**31 - 1])  # a repeat and an invalid one
    first = run_grad(c, attrs, DEV)
    again = run_grad(c, attrs, DEV)
    torch.cuda.synchronize()
    assert all(bitwise_equal(a, b) for a, b in zip(first, again))  # deterministic even then


# ---------------------------------------------------------------------------------------------
# SwiGLU
# ---------------------------------------------------------------------------------------------
SWIGLU_SHAPES = [(17, 256), (5, 1), (9, 257), (3, 259), (0, 64), (6, 2880)]


@pytest.mark.parametrize("T,H", SWIGLU_SHAPES)
@pytest.mark.parametrize("clamp", [-1.0, 2.0])
@pytest.mark.parametrize("group", [None, [3, 2], [100], [-4, 1]])
@dtype_params
def test_swiglu_forward_and_backward_match_reference_and_cpu(T, H, clamp, group, dtype, rng):
    x = randn((T, 2 * H), dtype, rng, std=2.0)
    w = randn((T,), torch.float32, rng)
    gi = None if group is None else torch.tensor(group, dtype=torch.int64)
    y = moegrad.swiglu_group(cu(x), weight=cu(w), group_index=cu(gi), clamp_limit=clamp)
    assert_close_to_ref(host(y), ref.swiglu_group(x, w, gi, clamp), dtype, what="y")
    cy = moegrad.swiglu_group(x, weight=w, group_index=gi, clamp_limit=clamp)
    assert_close_to_cpu(y, cy, dtype, what="y vs CPU")

    gy = randn((T, H), dtype, rng)
    yo = moegrad.swiglu_group(x, group_index=gi, clamp_limit=clamp)
    gx, gw = moegrad.swiglu_group_quant_backward(cu(gy), cu(x), weight=cu(w), y_origin=cu(yo),
                                                 group_index=cu(gi), clamp_limit=clamp)
    egx, egw = ref.swiglu_group_quant_backward(gy, x, w, yo, gi, clamp)
    mgx, mgw = ref.swiglu_backward_magnitude(gy, x, w, yo, gi, clamp)
    assert_close_to_ref(host(gx), egx, dtype, scale=mgx, what="grad_x")
    assert_close_to_ref(host(gw), egw, torch.float32, scale=mgw, n_reduce=H, what="grad_weight")
    cgx, cgw = moegrad.swiglu_group_quant_backward(gy, x, weight=w, y_origin=yo, group_index=gi,
                                                   clamp_limit=clamp)
    assert_close_to_cpu(gx, cgx, dtype, scale=mgx, what="grad_x vs CPU")
    assert_close_to_cpu(gw, cgw, torch.float32, scale=mgw, n_reduce=H, what="grad_weight vs CPU")


@dtype_params
def test_swiglu_misaligned_views(dtype, rng):
    T, H = 7, 64
    x = cu(randn((T, 2 * H), dtype, rng))
    gy = cu(randn((T, H), dtype, rng))
    y = moegrad.swiglu_group(x)
    gx, _ = moegrad.swiglu_group_quant_backward(gy, x)
    assert bitwise_equal(moegrad.swiglu_group(misaligned(x)), y)
    assert bitwise_equal(moegrad.swiglu_group_quant_backward(misaligned(gy), misaligned(x))[0], gx)


def test_swiglu_row_count_is_the_exact_sum(rng):
    """group_index [2^62 + 10, -2^62]: the exact sum is 10 on both backends (L8)."""
    T, H = 16, 64
    x = randn((T, 2 * H), torch.bfloat16, rng)
    gi = torch.tensor([2**62 + 10, -2**62], dtype=torch.int64)
    y = host(moegrad.swiglu_group(cu(x), group_index=cu(gi)))
    assert bitwise_equal(y[10:], torch.zeros_like(y[10:]))
    assert not bool((y[:10] == 0).all())
    assert_close_to_cpu(y, moegrad.swiglu_group(x, group_index=gi), torch.bfloat16, what="y")
    gx, _ = moegrad.swiglu_group_quant_backward(cu(randn((T, H), torch.bfloat16, rng)), cu(x),
                                                group_index=cu(gi))
    assert bitwise_equal(host(gx)[10:], torch.zeros((T - 10, 2 * H), dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# quantised SwiGLU
# ---------------------------------------------------------------------------------------------
QUANT_CASES = [  # dst, quant_mode, round_scale, H (partial blocks, odd H: the scalar path)
    (torch.float8_e4m3fn, 0, False, 256), (torch.float8_e4m3fn, 0, True, 300),
    (torch.float8_e5m2, 0, False, 129), (torch.float8_e4m3fn, 1, True, 96),
    (torch.float8_e5m2, 1, True, 2600), (torch.float8_e4m3fn, 0, False, 7168)]


@pytest.mark.parametrize("dst,mode,rs,H", QUANT_CASES,
                         ids=lambda v: str(v).replace("torch.float8_", ""))
@pytest.mark.parametrize("group", [None, [3, 2]])
@dtype_params
def test_swiglu_quant_matches_float64_formula(dst, mode, rs, H, group, dtype, rng):
    from test_swiglu_quant import check_values, swiglu64
    T = 7
    x = randn((T, 2 * H), dtype, rng, std=2.5)
    w = (0.2 + torch.rand(T, dtype=torch.float32))
    gi = None if group is None else torch.tensor(group, dtype=torch.int64)
    y, s, o = moegrad.swiglu_group_quant(cu(x), cu(w), cu(gi), dst_type=dst, quant_mode=mode,
                                         round_scale=rs, output_origin=True)
    assert y.is_cuda and y.dtype == dst
    check_values(x, host(y), host(s), dst, mode, rs, w, gi)
    assert_close_to_ref(host(o), swiglu64(x, w, gi).numpy(), dtype, what="y_origin")
    cy, cs, _ = moegrad.swiglu_group_quant(x, w, gi, dst_type=dst, quant_mode=mode,
                                           round_scale=rs)
    assert cs.shape == s.shape and cy.shape == y.shape
    # Codes agree with the CPU's except where the fp32 values straddle a rounding boundary.
    same = (host(y).view(torch.uint8) == cy.view(torch.uint8)).float().mean()
    assert float(same) > 0.98, f"only {float(same):.3f} of the codes equal the CPU's"


def test_swiglu_quant_misaligned_equals_aligned(rng):
    T, H = 5, 256
    x = cu(randn((T, 2 * H), torch.bfloat16, rng))
    a = moegrad.swiglu_group_quant(x, output_origin=True)
    b = moegrad.swiglu_group_quant(misaligned(x), output_origin=True)
    for u, v in zip(a, b):
        assert bitwise_equal(u, v)


# ---------------------------------------------------------------------------------------------
# init routing and its grad, finalize bias grad: integer results and bit copies, so CUDA equals
# the CPU bit for bit; the CPU is checked against the float64 reference in its own tests.
# ---------------------------------------------------------------------------------------------
INIT_ROUTING_KW = [
    dict(expert_num=16),
    dict(expert_num=16, expert_tokens_num_type=0),
    dict(expert_num=16, expert_tokens_num_type=2),
    dict(expert_num=16, active_num=50),
    dict(expert_num=16, row_idx_type=1),
    dict(expert_num=16, drop_pad_mode=1, expert_capacity=3),
    dict(expert_num=16, drop_pad_mode=1, expert_capacity=40, expert_tokens_num_type=0),
    dict(expert_num=16, active_expert_range=[4, 11]),
    dict(expert_num=16, active_expert_range=[4, 11], expert_tokens_num_type=2),
    dict(expert_num=16, active_expert_range=[4, 11], row_idx_type=1),
    dict(),  # no expert_num: every id >= 0 is in, ordered by id
    dict(row_idx_type=1),
]


@pytest.mark.parametrize("kw", INIT_ROUTING_KW, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "noE")
@pytest.mark.parametrize("R,K,H", [(37, 4, 64), (0, 2, 8), (5, 1, 259), (129, 8, 2880)])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_init_routing_matches_cpu_and_reference(kw, R, K, H, idx_dtype, rng):
    dtype = torch.bfloat16
    x = randn((R, H), dtype, rng)
    e = rand_expert_idx(R, K, 16, rng, dtype=idx_dtype, distinct=K <= 4)
    got = moegrad.moe_init_routing(cu(x), cu(e), **kw)
    want = moegrad.moe_init_routing(x, e, **kw)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.is_cuda or g.numel() == 0
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}"
        assert bitwise_equal(g, w), f"output {i} differs from the CPU"
    rex, ridx, rtok = ref.moe_init_routing(x, e, **kw)
    assert np.array_equal(host(got[1]).numpy(), ridx)
    assert np.array_equal(host(got[2]).numpy().reshape(rtok.shape), rtok)
    assert np.array_equal(ref.as_f64(host(got[0])).reshape(rex.shape), rex)


@pytest.mark.parametrize("align", [2, 16, 128])
@pytest.mark.parametrize("R,K,E,H", [(37, 4, 16, 64), (0, 2, 8, 8), (300, 8, 2048, 72),
                                     (129, 1, 2, 259)])
@pytest.mark.parametrize("window", [None, (3, 7)])
def test_init_routing_aligned_blocks_match_cpu(align, R, K, E, H, window, rng):
    """D36 on the device (no host copy): every output and the grad of the padded layout, bit for
    bit against the CPU kernel; padding rows are zero."""
    x = randn((R, H), torch.bfloat16, rng)
    e = rand_expert_idx(R, K, E, rng, distinct=True)
    kw = dict(expert_num=E, align_block=align)
    if window is not None:
        kw["active_expert_range"] = [min(window[0], E - 1), min(window[1], E)]
    got = moegrad.moe_init_routing(cu(x), cu(e), **kw)
    want = moegrad.moe_init_routing(x, e, **kw)
    assert len(got) == len(want) == 4
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.is_cuda
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}"
        assert bitwise_equal(g, w), f"output {i} differs from the CPU"
    g = randn(tuple(want[0].shape), torch.bfloat16, rng)
    rows = want[0].shape[0]
    gx = moegrad.moe_init_routing_grad(cu(g), got[1], K, padded_rows=rows)
    assert bitwise_equal(gx, moegrad.moe_init_routing_grad(g, want[1], K, padded_rows=rows))


@pytest.mark.parametrize("mode,active", [(0, 0), (0, 50), (1, 0)])
@dtype_params
def test_init_routing_grad_matches_cpu_and_reference(mode, active, dtype, rng):
    R, K, H, E = 41, 4, 96, 8
    kw = dict(expert_num=E, drop_pad_mode=mode, active_num=active,
              expert_capacity=12 if mode == 1 else 0)
    x = randn((R, H), dtype, rng)
    e = rand_expert_idx(R, K, E, rng)
    ex, idx, _ = moegrad.moe_init_routing(x, e, **kw)
    g = randn(tuple(ex.shape), dtype, rng)
    got = moegrad.moe_init_routing_grad(cu(g), cu(idx), K, drop_pad_mode=mode, active_num=active)
    want = moegrad.moe_init_routing_grad(g, idx, K, drop_pad_mode=mode, active_num=active)
    assert bitwise_equal(got, want)
    # The sum of K rows may cancel: judged against the sum of their magnitudes.
    assert_close_to_ref(host(got), ref.moe_init_routing_grad(g, idx, K, mode, active), dtype,
                        scale=ref.moe_init_routing_grad(g.abs(), idx, K, mode, active),
                        n_reduce=K)
    got64 = moegrad.moe_init_routing_grad(cu(g), cu(idx.long()), K, drop_pad_mode=mode,
                                          active_num=active)
    assert bitwise_equal(got64, want)


@pytest.mark.parametrize("with_scales", [False, True])
@pytest.mark.parametrize("R,K,H,E", [(33, 4, 256, 8), (7, 2, 259, 5), (0, 2, 16, 3)])
@dtype_params
def test_finalize_bias_grad_matches_cpu(with_scales, R, K, H, E, dtype, rng):
    gy = randn((R, H), dtype, rng)
    e = rand_expert_idx(R, K, E, rng, distinct=False)
    s = randn((R, K), dtype, rng) if with_scales else None
    got = torch.ops.moegrad.moe_finalize_routing_bias_grad(cu(gy), cu(e), cu(s), E)
    want = torch.ops.moegrad.moe_finalize_routing_bias_grad(gy, e, s, E)
    assert got.is_cuda and bitwise_equal(got, want)


# ---------------------------------------------------------------------------------------------
# no host synchronisation in a training step of the layer
# ---------------------------------------------------------------------------------------------
def test_moe_layer_step_makes_no_host_sync_and_captures():
    """A bf16 moegrad.nn.MoE forward + backward under set_sync_debug_mode("error"), then captured
    in a CUDA graph and replayed: scripts/device_calls.py sync (the device check's step)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "device_calls.py"), "sync"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "sync check:" in r.stdout


# ---------------------------------------------------------------------------------------------
# ClippedSwiglu (docs/operators.md §9)
# ---------------------------------------------------------------------------------------------
CLIPPED_SHAPES = [((17, 512), -1), ((9, 2 * 257), -1), ((5, 2), -1), ((0, 64), -1),
                  ((6, 5, 8), 0), ((3, 4, 6), 1), ((64, 5760), -1)]


@pytest.mark.parametrize("shape,dim", CLIPPED_SHAPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("clamp_mode", [0, 1])
@pytest.mark.parametrize("group", [None, [3, 2], [-4, 1]])
@dtype_params
def test_clipped_swiglu_matches_reference_and_cpu(shape, dim, interleaved, clamp_mode, group,
                                                  dtype, rng):
    x = randn(shape, dtype, rng, std=4.0)
    gi = None if group is None else torch.tensor(group, dtype=torch.int64)
    kw = dict(dim=dim, interleaved=interleaved, clamp_mode=clamp_mode)
    y = moegrad.clipped_swiglu(cu(x), cu(gi), **kw)
    ey, my = ref.clipped_swiglu(x, gi, **kw)
    assert_close_to_ref(host(y), ey, dtype, scale=my, what="y")
    assert_close_to_cpu(y, moegrad.clipped_swiglu(x, gi, **kw), dtype, scale=my, what="y vs CPU")
    gy = randn(tuple(y.shape), dtype, rng)
    gx = moegrad.clipped_swiglu_grad(cu(gy), cu(x), cu(gi), **kw)
    egx, mgx = ref.clipped_swiglu_grad(gy, x, gi, **kw)
    assert_close_to_ref(host(gx), egx, dtype, scale=mgx, n_reduce=2, what="grad_x")
    assert_close_to_cpu(gx, moegrad.clipped_swiglu_grad(gy, x, gi, **kw), dtype, scale=mgx,
                        n_reduce=2, what="grad_x vs CPU")


@pytest.mark.parametrize("interleaved", [True, False])
@dtype_params
def test_clipped_swiglu_misaligned_views(interleaved, dtype, rng):
    x = cu(randn((7, 128), dtype, rng, std=4.0))
    gy = cu(randn((7, 64), dtype, rng))
    y = moegrad.clipped_swiglu(x, interleaved=interleaved)
    gx = moegrad.clipped_swiglu_grad(gy, x, interleaved=interleaved)
    assert bitwise_equal(moegrad.clipped_swiglu(misaligned(x), interleaved=interleaved), y)
    assert bitwise_equal(moegrad.clipped_swiglu_grad(misaligned(gy), misaligned(x),
                                                     interleaved=interleaved), gx)


def test_clipped_swiglu_autograd_and_compile_on_cuda(rng):
    x = cu(randn((32, 96), torch.float32, rng, std=4.0)).requires_grad_(True)
    f = torch.compile(lambda t: moegrad.clipped_swiglu(t, cu(torch.tensor([20]))).square().sum(),
                      fullgraph=True)
    f(x).backward()
    g = moegrad.clipped_swiglu_grad(2 * moegrad.clipped_swiglu(x.detach()), x.detach(),
                                    cu(torch.tensor([20])))
    torch.testing.assert_close(x.grad, g)
    torch.library.opcheck(torch.ops.moegrad.clipped_swiglu.default, (x.detach(),),
                          dict(clamp_mode=1))


# ---------------------------------------------------------------------------------------------
# determinism, graphs, compile, opcheck
# ---------------------------------------------------------------------------------------------
def _workload(rng, dtype=torch.bfloat16, R=512, K=8, H=1024, N=128):
    x, bias = tie_free_gating_inputs(R, N, dtype, rng, K, norm_type=1, with_bias=True)
    c = dict(logits=cu(x), bias=cu(bias), xs=cu(randn((R * K, 2 * H), dtype, rng)),
             gy=cu(randn((R, H), dtype, rng)), w=cu(randn((R * K,), torch.float32, rng)),
             gi=cu(torch.tensor([R * K - 3], dtype=torch.int64)))
    return c


def _run_all(c, K=8):
    y, idx, norm = moegrad.moe_gating_top_k(c["logits"], K, bias=c["bias"], norm_type=1,
                                            out_flag=True)
    R = idx.shape[0]
    gxg = moegrad.moe_gating_top_k_backward(norm, y.float(), idx)
    h = moegrad.swiglu_group(c["xs"], weight=c["w"], group_index=c["gi"])
    row_idx = torch.arange(R * K, device=DEV, dtype=torch.int32)
    out = moegrad.moe_finalize_routing(h, row_idx, scales=y, drop_pad_mode=2, k=K)
    gex, gs = moegrad.moe_finalize_routing_grad(c["gy"], row_idx, expanded_x=h, scales=y)
    gx, gw = moegrad.swiglu_group_quant_backward(gex, c["xs"], weight=c["w"], y_origin=h,
                                                 group_index=c["gi"])
    return [y, idx, norm, gxg, h, out, gex, gs, gx, gw]


def test_bitwise_repeatable(rng):
    c = _workload(rng)
    a = _run_all(c)
    b = _run_all(c)
    for i, (u, v) in enumerate(zip(a, b)):
        assert bitwise_equal(u, v), f"output {i} differs between runs"


def test_cuda_graph_capture_and_replay(rng):
    c = _workload(rng)
    eager = _run_all(c)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run_all(c)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = _run_all(c)
    for t in outs:
        t.zero_()
    g.replay()
    torch.cuda.synchronize()
    for i, (u, v) in enumerate(zip(outs, eager)):
        assert bitwise_equal(u, v), f"graph output {i} differs from eager"
    c["gy"].mul_(2.0)  # new input data, same buffers
    g.replay()
    torch.cuda.synchronize()
    assert bitwise_equal(outs[6], (eager[6].float() * 2).to(eager[6].dtype))


def test_torch_compile_fullgraph(rng):
    c = _workload(rng, R=64, H=128)
    fn = torch.compile(_run_all, fullgraph=True)
    got = fn(c)
    want = _run_all(c)
    for i, (u, v) in enumerate(zip(got, want)):
        assert bitwise_equal(u, v), f"compiled output {i} differs"


def test_opcheck_on_cuda(rng):
    from torch.library import opcheck
    R, K, H, N = 8, 2, 32, 16
    x = cu(randn((R, N), torch.float32, rng))
    opcheck(torch.ops.moegrad.moe_gating_top_k.default, (x, K),
            dict(norm_type=1, out_flag=True), test_utils=("test_schema", "test_faketensor"))
    xn = torch.sigmoid(x)
    e = cu(rand_expert_idx(R, K, N, rng))
    opcheck(torch.ops.moegrad.moe_gating_top_k_backward.default,
            (xn, cu(randn((R, K), torch.float32, rng)), e))
    h = cu(randn((R * K, H), torch.float32, rng))
    idx = cu(rand_perm_idx(R * K, rng))
    s = cu(randn((R, K), torch.float32, rng))
    opcheck(torch.ops.moegrad.moe_finalize_routing.default, (h, idx),
            dict(scales=s, drop_pad_mode=2, k=K))
    opcheck(torch.ops.moegrad.moe_finalize_routing_grad.default,
            (cu(randn((R, H), torch.float32, rng)), idx), dict(expanded_x=h, scales=s))
    xs = cu(randn((R, 2 * H), torch.float32, rng))
    opcheck(torch.ops.moegrad.swiglu_group.default, (xs,), dict(weight=s[:, 0].contiguous()))
    opcheck(torch.ops.moegrad.swiglu_group_quant_backward.default,
            (cu(randn((R, H), torch.float32, rng)), xs))


def test_autograd_through_all_ops_on_cuda(rng):
    R, K, H, N = 16, 4, 64, 32
    logits = cu(randn((R, N), torch.float32, rng)).requires_grad_()
    xs = cu(randn((R * K, 2 * H), torch.float32, rng)).requires_grad_()
    y, idx, _ = moegrad.moe_gating_top_k(logits, K, norm_type=1)
    h = moegrad.swiglu_group(xs)
    row_idx = torch.arange(R * K, device=DEV, dtype=torch.int32)
    out = moegrad.moe_finalize_routing(h, row_idx, scales=y, drop_pad_mode=0, k=K)
    out.square().sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert xs.grad is not None and torch.isfinite(xs.grad).all()


# ---------------------------------------------------------------------------------------------
# strict index mode (MOEGRAD_STRICT_INDICES=1)
# ---------------------------------------------------------------------------------------------
def test_strict_indices_report_first_bad_position(rng, monkeypatch):
    monkeypatch.setenv("MOEGRAD_STRICT_INDICES", "1")
    M, N, K = 4, 8, 2
    xn = cu(torch.sigmoid(randn((M, N), torch.float32, rng)))
    gy = cu(randn((M, K), torch.float32, rng))
    e = torch.zeros((M, K), dtype=torch.int32)
    e[2, 1] = N
    with pytest.raises(moegrad.MoeError, match=r"flat position 5") as info:
        moegrad.moe_gating_top_k_backward(xn, gy, cu(e))
    assert info.value.code == 161002
    R = 3
    idx = torch.tensor([0, 1, 2, 3, 1, 5], dtype=torch.int32)
    with pytest.raises(moegrad.MoeError, match=r"positions 1 and 4") as info:
        moegrad.moe_finalize_routing(cu(randn((R * K, 8), torch.float32, rng)), cu(idx),
                                     drop_pad_mode=2, k=K)
    assert info.value.code == 561103
    monkeypatch.delenv("MOEGRAD_STRICT_INDICES")
    moegrad.moe_finalize_routing(cu(randn((R * K, 8), torch.float32, rng)), cu(idx),
                                 drop_pad_mode=2, k=K)  # not checked: no error


# ---------------------------------------------------------------------------------------------
# the demo
# ---------------------------------------------------------------------------------------------
def test_demo_runs_on_cuda(tmp_path):
    # Any text trains the demo; the repository's own docs stand in where fortunes is missing.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    docs = os.path.join(root, "docs")
    text = b"".join(open(os.path.join(docs, n), "rb").read()
                    for n in sorted(os.listdir(docs)) if n.endswith(".md"))
    data = tmp_path / "text.txt"
    data.write_bytes(text)
    r = subprocess.run([sys.executable, "-m", "moegrad.demo", "--device", "cuda", "--steps", "5",
                        "--data", str(data), "--quiet", "--check-every", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
