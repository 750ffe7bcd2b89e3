"""The gather/scatter row kernels of the CPU backend (finalize routing forward and grad, init
routing grad, gating top-k backward; docs/performance.md "Gather/scatter kernels").

* Operation order: the elementwise results equal, bit for bit, a step-by-step float32
  emulation of the documented formula (every operation rounded on its own, no FMA contraction;
  docs/decisions.md L43, L78), which is what the CUDA kernels compute too.
* Row shapes: H (or N) around the vector widths (tails of 1 to 63 elements), misaligned views
  (rows that cannot take non-temporal stores), fp32 / fp16 / bf16.
* Threads: 1, 2, 3 and 5 threads give the same bits; the finalize grad's parallel
  covered-rows pass zeroes every row no slot addresses and writes every element of a poisoned
  output, at each thread count.
* Gating backward: rows of 2 to 257 experts, K from 1 to 40, repeated expert ids, batches of
  rows and single rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moegrad
import reference as ref
from _util_validation import assert_fully_written, threads
from conftest import (assert_close_to_ref, poison, rand_droppad_idx, rand_expert_idx,
                      rand_perm_idx, randn)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
THREADS = (1, 2, 3, 5)
WIDTHS = (1, 7, 16, 17, 33, 64, 100, 129)


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8).clone()


def _misaligned(t):
    """The same values in a view whose rows start one element off a vector boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    v = flat[1:].view(t.shape)
    v.copy_(t)
    return v


def _f32(t):
    return t.to(F32)


# --------------------------------------------------------------------------------------------
# finalize routing forward
# --------------------------------------------------------------------------------------------
def _finalize_forward_emulated(ex, idx, x1, x2, bias, scales, eidx, mode):
    """out[r] = x1 + x2 + sum_k s_k (x_k + b_k), each fp32 operation rounded on its own."""
    R, H = x1.shape
    K = scales.shape[1]
    rows_ex = ex.reshape(-1, H)
    acc = _f32(x1) + _f32(x2)
    flat = idx.long()
    for k in range(K):
        f = flat.view(R, K)[:, k] if mode in (2, 3) else flat[k * R:(k + 1) * R]
        valid = (f >= 0) & (f < rows_ex.shape[0])
        x = _f32(rows_ex[f.clamp(0, rows_ex.shape[0] - 1)])
        e = eidx[:, k].long()
        has_b = (e >= 0) & (e < bias.shape[0])
        b = _f32(bias[e.clamp(0, bias.shape[0] - 1)])
        s = _f32(scales[:, k])[:, None]
        both = acc + s * (x + b)
        only_x = acc + s * x
        only_b = acc + s * b
        acc = torch.where((valid & has_b)[:, None], both,
                          torch.where(valid[:, None], only_x,
                                      torch.where(has_b[:, None], only_b, acc)))
    return acc.to(x1.dtype)


@DTYPES
@pytest.mark.parametrize("H", WIDTHS)
@pytest.mark.parametrize("mode", [0, 3])
def test_finalize_forward_exact_order_tails_threads(dtype, H, mode, rng):
    R, K, E, C = 37, 4, 5, 9
    if mode == 0:
        ex = randn((R * K, H), dtype, rng)
        idx = rand_perm_idx(R * K, rng)
    else:  # drop-pad, row layout: dropped slots keep their bias term
        ex = randn((E, C, H), dtype, rng)
        idx = rand_droppad_idx(R * K, E, C, rng)
    x1, x2 = randn((R, H), dtype, rng), randn((R, H), dtype, rng)
    bias = randn((E, H), dtype, rng)
    scales = randn((R, K), dtype, rng)
    eidx = rand_expert_idx(R, K, E, rng, distinct=False)
    want = _bits(_finalize_forward_emulated(ex, idx, x1, x2, bias, scales, eidx, mode))
    for n in THREADS:
        with threads(n):
            out = torch.empty((R, H), dtype=dtype)
            poison(out)
            moegrad._C.moe_finalize_routing(ex, idx, x1, x2, bias, scales, eidx, mode, out)
            assert torch.equal(_bits(out), want), f"{n} threads: not the fp32 operation order"
            mis = _misaligned(torch.empty((R, H), dtype=dtype))
            poison(mis)
            moegrad._C.moe_finalize_routing(_misaligned(ex), idx, _misaligned(x1),
                                            _misaligned(x2), bias, scales, eidx, mode, mis)
            assert torch.equal(_bits(mis), want), f"{n} threads, misaligned rows"


# --------------------------------------------------------------------------------------------
# finalize routing grad
# --------------------------------------------------------------------------------------------
def _run_grad(gy, idx, ex, scales, eidx, bias, mode, active_num, E, C):
    R, H = gy.shape
    n = idx.numel()
    shape = (active_num if 0 < active_num < n else n, H) if mode == 0 else (E, C, H)
    gex = torch.empty(shape, dtype=gy.dtype)
    gsc = torch.empty(tuple(scales.shape), dtype=scales.dtype)
    poison(gex)
    poison(gsc)
    moegrad._C.moe_finalize_routing_grad(gy, idx, ex, scales, eidx, bias, mode, active_num,
                                         E if mode else 0, C if mode else 0, gex, gsc)
    return gex, gsc


@DTYPES
@pytest.mark.parametrize("H", WIDTHS)
@pytest.mark.parametrize("mode,active", [(0, 0), (0, 1), (1, 0)],
                         ids=["dropless", "truncated", "droppad"])
def test_finalize_grad_covered_rows_exact_tails_threads(dtype, H, mode, active, rng):
    R, K, E, C = 41, 3, 6, 11
    n = R * K
    active_num = n - 29 if active else 0
    if mode == 0:
        rows = active_num or n
        ex = randn((rows, H), dtype, rng)
        idx = rand_perm_idx(n, rng)
    else:  # many capacity rows no slot addresses
        ex = randn((E, C, H), dtype, rng)
        idx = rand_droppad_idx(n, E, C, rng, n_keep=E * C // 2)
    gy = randn((R, H), dtype, rng)
    scales = randn((R, K), dtype, rng)
    bias = randn((E, H), dtype, rng)
    eidx = rand_expert_idx(R, K, E, rng, distinct=False)
    case = dict(grad_y=gy, expanded_row_idx=idx, expanded_x=ex, scales=scales,
                expert_idx=eidx, bias=bias, drop_pad_mode=mode, active_num=active_num,
                expert_num=E if mode else 0, expert_capacity=C if mode else 0)
    exp_gex, exp_gsc = ref.moe_finalize_routing_grad(**case)
    _, mag_gsc = ref.moe_finalize_routing_grad(**case, _abs=True)

    # grad_expanded_x: g * s in fp32, one rounding; rows no valid index addresses are +0.
    flat_rows = ex.reshape(-1, H).shape[0]
    want = torch.zeros((flat_rows, H), dtype=F32)
    iv = idx.long()
    ok = (iv >= 0) & (iv < flat_rows)
    slot = torch.arange(n)[ok]
    want[iv[ok]] = _f32(gy)[slot // K] * _f32(scales).reshape(-1)[slot][:, None]
    want = _bits(want.to(dtype))
    covered = torch.zeros(flat_rows, dtype=torch.bool)
    covered[iv[ok]] = True
    assert mode == 0 or not bool(covered.all()), "drop-pad: some capacity rows must be uncovered"

    first = None
    for nt in THREADS:
        with threads(nt):
            gex, gsc = _run_grad(gy, idx, ex, scales, eidx, bias, mode, active_num, E, C)
        assert_fully_written(gex, f"grad_expanded_x, {nt} threads")
        assert_fully_written(gsc, f"grad_scales, {nt} threads")
        assert torch.equal(_bits(gex), want), f"grad_expanded_x with {nt} threads"
        assert torch.all(gex.reshape(-1, H)[~covered] == 0)
        assert_close_to_ref(gsc, exp_gsc, dtype, scale=mag_gsc, n_reduce=H, what="grad_scales")
        if first is None:
            first = _bits(gsc)
        assert torch.equal(_bits(gsc), first), f"grad_scales: 1 and {nt} threads differ"
    with threads(2):  # misaligned rows: regular stores instead of non-temporal ones
        mis = _misaligned(gy)
        gex, gsc = _run_grad(mis, idx, _misaligned(ex), scales, eidx, bias, mode, active_num,
                             E, C)
    assert torch.equal(_bits(gex), want) and torch.equal(_bits(gsc), first)


# --------------------------------------------------------------------------------------------
# init routing grad
# --------------------------------------------------------------------------------------------
@DTYPES
@pytest.mark.parametrize("H", WIDTHS)
def test_init_routing_grad_exact_order_tails_threads(dtype, H, rng):
    R, K = 43, 5
    n = R * K
    active_num = n - 17  # slots addressing rows >= active_num are skipped
    g = randn((active_num, H), dtype, rng)
    idx = rand_perm_idx(n, rng)
    acc = torch.zeros((R, H), dtype=F32)
    iv = idx.long().view(R, K)
    for k in range(K):
        d = iv[:, k]
        ok = (d >= 0) & (d < active_num)
        acc = torch.where(ok[:, None], acc + _f32(g[d.clamp(0, active_num - 1)]), acc)
    want = _bits(acc.to(dtype))
    np.testing.assert_allclose(acc.double().numpy(),
                               ref.moe_init_routing_grad(g, idx, K, 0, active_num),
                               rtol=1e-5, atol=1e-5)
    for nt in THREADS:
        with threads(nt):
            out = torch.empty((R, H), dtype=dtype)
            poison(out)
            moegrad._C.moe_init_routing_grad(g, idx, K, 0, active_num, out)
            assert torch.equal(_bits(out), want), f"{nt} threads"
            mis = _misaligned(torch.empty((R, H), dtype=dtype))
            poison(mis)
            moegrad._C.moe_init_routing_grad(_misaligned(g), idx, K, 0, active_num, mis)
            assert torch.equal(_bits(mis), want), f"{nt} threads, misaligned rows"


# --------------------------------------------------------------------------------------------
# gating top-k backward
# --------------------------------------------------------------------------------------------
def _gating_backward_emulated(xn, gy, e, renorm, norm_type, rsf, eps):
    M, N = xn.shape
    K = gy.shape[1]
    f = np.float32
    x = xn.numpy().astype(f)
    g = gy.to(F32).numpy()
    ev = e.numpy()
    out = np.zeros((M, N), dtype=f)
    for r in range(M):
        w = [x[r, j] if 0 <= j < N else f(0) for j in ev[r]]
        gs = [f(f(rsf) * g[r, k]) for k in range(K)]
        s = f(0)
        for v in w:
            s = f(s + v)
        if norm_type != 0 or renorm == 1:
            den = f(f(eps) + s)
            beta = f(0)
            for k in range(K):
                beta = f(beta + f(f(w[k] / den) * gs[k]))
            gp = [f(f(gs[k] - beta) / den) for k in range(K)]
        else:
            gp = gs
        G = np.zeros(N, dtype=f)
        for k in range(K):
            if 0 <= ev[r, k] < N:
                G[ev[r, k]] = f(G[ev[r, k]] + gp[k])
        if norm_type == 1:
            out[r] = (x[r] * (f(1) - x[r])) * G
        else:
            dot = f(0)
            for k in range(K):
                dot = f(dot + f(w[k] * gp[k]))
            out[r] = x[r] * (G - dot)
    return torch.from_numpy(out)


@DTYPES
@pytest.mark.parametrize("N,K", [(2, 1), (2, 2), (16, 2), (17, 4), (32, 4), (33, 16), (48, 8),
                                 (64, 8), (64, 17), (65, 2), (100, 40), (128, 4), (200, 8),
                                 (256, 4), (256, 8), (257, 3), (257, 8)])
@pytest.mark.parametrize("norm_type,renorm", [(1, 0), (0, 1), (0, 0)])
def test_gating_backward_exact_order_tails_threads(dtype, N, K, norm_type, renorm, rng):
    # 70 rows: whole batches of a vector's worth of rows (the slot scalars one row per lane;
    # on AVX-512 with K in {2, 4, 8} and N <= 64 built by lane permutations, G in registers)
    # and rows after them, at 1, 2 and 3 threads; with 5 threads (14-row chunks) no whole
    # batch on AVX-512. On AVX-512, 64 < N <= 256 with K in {2, 4, 8} takes batches with
    # gathered scores and a G tile (L120; N = 65, 200: row tails after the bf16 pairs); N = 257,
    # other K and K > 16 rows take the pipelined one-row form (L119).
    M = 70
    logits = randn((M, N), F32, rng)
    xn = torch.sigmoid(logits) if norm_type == 1 else torch.softmax(logits, dim=1)
    gy = randn((M, K), dtype, rng)
    e = rand_expert_idx(M, K, N, rng, distinct=False)  # repeats are summed (D1)
    want = _bits(_gating_backward_emulated(xn, gy, e, renorm, norm_type, 1.5, 1e-9).to(dtype))
    for nt in THREADS:
        with threads(nt):
            gx = torch.empty((M, N), dtype=dtype)
            poison(gx)
            moegrad._C.moe_gating_top_k_backward(xn, gy, e, renorm, norm_type, 1.5, 1e-9, gx)
            assert torch.equal(_bits(gx), want), f"{nt} threads: not the fp32 operation order"


@DTYPES
@pytest.mark.parametrize("N,K", [(16, 2), (32, 4), (64, 8), (200, 8), (256, 4)])
@pytest.mark.parametrize("renorm", [0, 1])
def test_gating_backward_sqrt_softplus_batches_equal_one_row_form(dtype, N, K, renorm, rng):
    # sqrt-softplus (norm type 2) has no step-by-step emulation here: the batches (1-3 threads:
    # whole batches of 16 rows; on AVX-512 reg::Rows / reg::Wide) must give the bits of the
    # one-row form (5 threads: 14-row chunks, no whole batch), which the float64 tests of
    # test_autograd.py check.
    M = 70
    xn = torch.sqrt(torch.nn.functional.softplus(randn((M, N), F32, rng)))
    gy = randn((M, K), dtype, rng)
    e = rand_expert_idx(M, K, N, rng, distinct=False)
    outs = []
    for nt in (5,) + tuple(t for t in THREADS if t != 5):
        with threads(nt):
            gx = torch.empty((M, N), dtype=dtype)
            poison(gx)
            moegrad._C.moe_gating_top_k_backward(xn, gy, e, renorm, 2, 1.5, 1e-9, gx)
            outs.append(_bits(gx))
    assert not torch.isnan(gx.float()).any()
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), "batches differ from the one-row form"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,K", [(32, 4), (96, 2), (256, 8), (257, 8)])
@pytest.mark.parametrize("norm_type,renorm", [(1, 0), (0, 1)])
def test_gating_backward_denormal_outputs_exact(dtype, N, K, norm_type, renorm, rng):
    # Odd rows: scores of 1e-30 to 1e-45 and gradients down to 1e-30, so their outputs are
    # denormal, zero or tiny normals, and the output vector pairs of bf16 rows have denormal
    # lanes: those leave VCVTNE2PS2BF16 (which flushes them) for the per-vector path (L117,
    # L121). Even rows are ordinary.
    M = 70
    logits = randn((M, N), F32, rng)
    xn = torch.sigmoid(logits) if norm_type == 1 else torch.softmax(logits, dim=1)
    xn[1::2] = torch.from_numpy(10.0 ** -rng.uniform(30, 45, (M // 2, N))).to(F32)
    gscale = torch.from_numpy(10.0 ** -rng.uniform(0, 30, (M, 1))).to(F32)
    gscale[::2] = 1.0
    gy = (randn((M, K), F32, rng) * gscale).to(dtype)
    e = rand_expert_idx(M, K, N, rng, distinct=False)
    exact = _gating_backward_emulated(xn, gy, e, renorm, norm_type, 1.5, 1e-9)
    want = _bits(exact.to(dtype))
    assert ((exact != 0) & (exact.abs() < torch.finfo(F32).tiny)).any(), "no denormal output"
    for nt in THREADS:
        with threads(nt):
            gx = torch.empty((M, N), dtype=dtype)
            poison(gx)
            moegrad._C.moe_gating_top_k_backward(xn, gy, e, renorm, norm_type, 1.5, 1e-9, gx)
            assert torch.equal(_bits(gx), want), f"{nt} threads: denormal outputs differ"


# --------------------------------------------------------------------------------------------
# outputs of 8 MB and more: non-temporal stores (whole lines, single vectors, rows of either
# alignment: H = 2056 alternates 64-byte-aligned and 32-byte-aligned fp32 rows) and row tails
# --------------------------------------------------------------------------------------------
@DTYPES
def test_large_outputs_take_the_streaming_path(dtype, rng):
    R, K, H, E = 2048 if dtype != F32 else 1024, 4, 2056, 8
    n = R * K
    assert R * H * torch.empty(0, dtype=dtype).element_size() >= 8 << 20
    ex = randn((n, H), dtype, rng)
    idx = rand_perm_idx(n, rng)
    x1, x2 = randn((R, H), dtype, rng), randn((R, H), dtype, rng)
    bias, scales = randn((E, H), dtype, rng), randn((R, K), dtype, rng)
    eidx = rand_expert_idx(R, K, E, rng, distinct=False)
    fwd = _bits(_finalize_forward_emulated(ex, idx, x1, x2, bias, scales, eidx, 0))
    gy = randn((R, H), dtype, rng)
    iv = idx.long()
    gex_want = torch.empty((n, H), dtype=F32)
    gex_want[iv] = _f32(gy)[torch.arange(n) // K] * _f32(scales).reshape(-1)[:, None]
    gex_want = _bits(gex_want.to(dtype))
    acc = torch.zeros((R, H), dtype=F32)
    for k in range(K):
        acc = acc + _f32(ex[iv.view(R, K)[:, k]])
    init_want = _bits(acc.to(dtype))
    for nt in (1, 3):
        with threads(nt):
            out = torch.empty((R, H), dtype=dtype)
            poison(out)
            moegrad._C.moe_finalize_routing(ex, idx, x1, x2, bias, scales, eidx, 0, out)
            assert torch.equal(_bits(out), fwd), f"finalize forward, {nt} threads"
            gex, gsc = _run_grad(gy, idx, ex, scales, eidx, bias, 0, 0, E, 0)
            assert torch.equal(_bits(gex), gex_want), f"finalize grad, {nt} threads"
            assert_fully_written(gsc, "grad_scales")
            gx = torch.empty((R, H), dtype=dtype)
            poison(gx)
            moegrad._C.moe_init_routing_grad(ex, idx, K, 0, 0, gx)
            assert torch.equal(_bits(gx), init_want), f"init routing grad, {nt} threads"
