"""D16: every operator is deterministic and bitwise reproducible, run to run and for any CPU
thread count (1, 2 and an odd 3, which forces uneven splits). Sizes are large enough for the
kernels to split rows and hidden columns across threads (M = 512, H = 1024)."""

from __future__ import annotations

import pytest
import torch

import moegrad
from _util_validation import gen, rand, randn, randperm, threads, upstream  # noqa: F401

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I32, I64 = torch.int32, torch.int64
THREADS = (1, 2, 3)


def _bits(out):
    out = out if isinstance(out, tuple) else (out,)
    return [t.detach().contiguous().view(-1).view(torch.uint8).clone() for t in out]


def _same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _check_deterministic(fn):
    runs = {}
    for n in THREADS:
        with threads(n):
            assert moegrad._C.get_num_threads() == n
            runs[n] = _bits(fn())
            if n == 2:
                again = _bits(fn())
                assert _same(runs[n], again), "two runs with 2 threads differ"
    for n in THREADS[1:]:
        assert _same(runs[THREADS[0]], runs[n]), f"1 thread and {n} threads differ"


def _rows_idx(g, M, N, K):
    return torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(M)]).to(I32)


def _droppad_idx(g, n, slots):
    idx = torch.randperm(slots, generator=g)[:n].to(I32)
    idx[torch.randperm(n, generator=g)[:n // 8]] = -1
    return idx


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm_type,renorm,groups", [(1, 0, True), (0, 1, False), (2, 0, True)])
def test_gating_forward(gen, dtype, norm_type, renorm, groups):
    M, N, k = 512, 256, 8
    x = randn(gen, M, N, dtype=dtype, scale=2.0)
    bias = randn(gen, N, dtype=dtype, scale=0.1)
    kw = dict(k_group=4, group_count=8, group_select_mode=1) if groups else {}
    _check_deterministic(lambda: moegrad.moe_gating_top_k(
        x, k, bias=bias, renorm=renorm, norm_type=norm_type, out_flag=True,
        routed_scaling_factor=2.5, eps=1e-20, **kw))


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_gating_backward(gen, dtype):
    M, N, K = 512, 256, 8
    xn = rand(gen, M, N, lo=0.01, hi=0.99)
    gy = upstream(gen, M, K, dtype=dtype)
    idx = _rows_idx(gen, M, N, K)
    _check_deterministic(lambda: moegrad.moe_gating_top_k_backward(
        xn, gy, idx, routed_scaling_factor=1.7, eps=1e-10))


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_finalize_forward(gen, mode, dtype):
    R, K, H, E, C = 512, 4, 1024, 16, 160
    ex = randn(gen, R * K, H, dtype=dtype) if mode in (0, 2) else randn(gen, E, C, H, dtype=dtype)
    idx = randperm(gen, R * K) if mode in (0, 2) else _droppad_idx(gen, R * K, E * C)
    x1, x2 = randn(gen, R, H, dtype=dtype), randn(gen, R, H, dtype=dtype)
    bias, sc = randn(gen, E, H, dtype=dtype), rand(gen, R, K, dtype=dtype)
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32)
    _check_deterministic(lambda: moegrad.moe_finalize_routing(
        ex, idx, x1=x1, x2=x2, bias=bias, scales=sc, expert_idx=eid, drop_pad_mode=mode))


@pytest.mark.parametrize("mode,active_num", [(0, 0), (0, 1500), (1, 0)])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_finalize_grad(gen, mode, active_num, dtype):
    R, K, H, E, C = 512, 4, 1024, 16, 160
    rows = active_num if 0 < active_num < R * K else R * K
    ex = randn(gen, rows, H, dtype=dtype) if mode == 0 else randn(gen, E, C, H, dtype=dtype)
    idx = randperm(gen, R * K) if mode == 0 else _droppad_idx(gen, R * K, E * C)
    bias, sc = randn(gen, E, H, dtype=dtype), rand(gen, R, K, dtype=dtype)
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32)
    gy = upstream(gen, R, H, dtype=dtype)
    _check_deterministic(lambda: moegrad.moe_finalize_routing_grad(
        gy, idx, ex, sc, eid, bias, drop_pad_mode=mode, active_num=active_num,
        expert_num=E if mode else 0, expert_capacity=C if mode else 0))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_swiglu_forward(gen, dtype):
    T, H = 512, 1024
    x = randn(gen, T, 2 * H, dtype=dtype, scale=2.0)
    w = rand(gen, T, lo=0.1, hi=1.0)
    gi = torch.tensor([100, 0, 250, 120], dtype=I64)
    _check_deterministic(lambda: moegrad.swiglu_group(x, weight=w, group_index=gi,
                                                      clamp_limit=3.0))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_swiglu_backward(gen, dtype):
    T, H = 512, 1024
    x = randn(gen, T, 2 * H, dtype=dtype, scale=2.0)
    w = rand(gen, T, lo=0.1, hi=1.0)
    gy = upstream(gen, T, H, dtype=dtype)
    yo = randn(gen, T, H, dtype=dtype)
    gi = torch.tensor([300, 150], dtype=I64)
    _check_deterministic(lambda: moegrad.swiglu_group_quant_backward(
        gy, x, weight=w, y_origin=yo, group_index=gi, clamp_limit=3.0))


def test_autograd_chain(gen):
    """The gradients of the three forwards chained (gating -> swiglu -> finalize). The expert
    inputs are a leaf (not h[tok]) so that no torch op with a non-deterministic backward
    (index_put_ accumulate) sits in the chain."""
    R, N, K, H = 512, 64, 4, 256
    logits = randn(gen, R, N, scale=2.0)
    xs = randn(gen, R * K, 2 * H)
    w = rand(gen, R * K, lo=0.2)
    gy = upstream(gen, R, H)

    def run():
        lg = logits.clone().requires_grad_()
        xx = xs.clone().requires_grad_()
        ww = w.clone().requires_grad_()
        y, idx, _ = moegrad.moe_gating_top_k(lg, K, k_group=2, group_count=4, norm_type=1,
                                             out_flag=True)
        flat_e = idx.t().reshape(-1).long()
        order = torch.argsort(flat_e, stable=True)
        row_idx = torch.empty_like(order)
        row_idx[order] = torch.arange(R * K)
        act = moegrad.swiglu_group(xx, weight=ww, group_index=torch.bincount(flat_e, minlength=N),
                                   clamp_limit=2.5)
        out = moegrad.moe_finalize_routing(act, row_idx, scales=y, k=K)
        out.backward(gy)
        return out, lg.grad, xx.grad, ww.grad

    _check_deterministic(run)
