"""Concurrency through the Python front (docs/decisions.md L54, D16).

16 threads call every moegrad operator at once on distinct inputs (the native run call releases
the GIL, so the kernels really overlap) and must reproduce the serial results bit for bit; the
errors each thread provokes carry that thread's own values.
"""

from __future__ import annotations

import threading

import pytest
import torch

import moegrad

THREADS = 16
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _inputs(t: int):
    """Per-thread inputs of every op: shapes, dtypes and attributes vary with t."""
    g = torch.Generator().manual_seed(7919 * (t + 1))
    dt = DTYPES[t % 3]
    M, N, K = 9 + t, 32, 1 + t % 6
    R, H, E = 5 + t, 24 + t, 6
    T = 11 + t
    xn = torch.rand(M, N, generator=g) * 0.9 + 0.05
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(M)]).int()
    col = torch.randperm(R * K, generator=g).int()
    return dict(
        gating=(torch.randn(M, N, generator=g).to(dt), 4),
        gating_kw=dict(k_group=2, group_count=4, norm_type=t % 3, renorm=1 if t % 3 == 0 else 0,
                       out_flag=True, routed_scaling_factor=1.5),
        gating_bwd=(xn, torch.randn(M, K, generator=g).to(dt), idx),
        finalize=(torch.randn(R * K, H, generator=g).to(dt), col,
                  torch.randn(R, H, generator=g).to(dt), torch.randn(R, H, generator=g).to(dt),
                  torch.randn(E, H, generator=g).to(dt), torch.rand(R, K, generator=g).to(dt),
                  torch.randint(0, E, (R, K), generator=g, dtype=torch.int32)),
        finalize_grad=(torch.randn(R, H, generator=g).to(dt), col,
                       torch.randn(R * K, H, generator=g).to(dt),
                       torch.rand(R, K, generator=g).to(dt),
                       torch.randint(0, E, (R, K), generator=g, dtype=torch.int32),
                       torch.randn(E, H, generator=g).to(dt)),
        swiglu=(torch.randn(T, 2 * H, generator=g).to(dt) * 3, torch.rand(T, generator=g),
                torch.tensor([T - 2, 1])),
        swiglu_bwd=(torch.randn(T, H, generator=g).to(dt), torch.randn(T, 2 * H, generator=g).to(dt) * 3,
                    torch.rand(T, generator=g), torch.randn(T, H, generator=g).to(dt),
                    torch.tensor([3, T // 2, 1])),
    )


def _run_all(a):
    """Every op once; a flat list of output tensors."""
    out = list(moegrad.moe_gating_top_k(*a["gating"], **a["gating_kw"]))
    out.append(moegrad.moe_gating_top_k_backward(*a["gating_bwd"], routed_scaling_factor=0.7))
    out.append(moegrad.moe_finalize_routing(*a["finalize"], drop_pad_mode=0))
    out.extend(moegrad.moe_finalize_routing_grad(*a["finalize_grad"]))
    out.append(moegrad.swiglu_group(*a["swiglu"], clamp_limit=3.0))
    out.extend(moegrad.swiglu_group_quant_backward(*a["swiglu_bwd"], clamp_limit=3.0))
    return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _in_threads(fn):
    """Runs fn(t) in THREADS threads started together; re-raises the first failure."""
    barrier = threading.Barrier(THREADS)
    errors = [None] * THREADS

    def body(t):
        try:
            barrier.wait()
            fn(t)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors[t] = e

    pool = [threading.Thread(target=body, args=(t,)) for t in range(THREADS)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    for t, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"thread {t}: {e!r}") from e


def test_sixteen_threads_every_op_bitwise_equal_to_serial():
    inputs = [_inputs(t) for t in range(THREADS)]
    serial = [_run_all(a) for a in inputs]

    def body(t):
        for _ in range(3):
            got = _run_all(inputs[t])
            for i, (x, y) in enumerate(zip(got, serial[t])):
                assert _bitwise_equal(x, y), f"output {i} differs from the serial run"

    _in_threads(body)


def test_sixteen_threads_autograd_bitwise_equal_to_serial():
    def step(t):
        g = torch.Generator().manual_seed(31 * t + 1)
        x = torch.randn(8 + t, 2 * (8 + t), generator=g).requires_grad_()
        w = torch.rand(8 + t, generator=g).requires_grad_()
        y = moegrad.swiglu_group(x, weight=w, clamp_limit=4.0)
        logits = torch.randn(6 + t, 16, generator=g).requires_grad_()
        gw, _, _ = moegrad.moe_gating_top_k(logits, 3, norm_type=1)
        (y.square().sum() + gw.sum()).backward()
        return [x.grad, w.grad, logits.grad]

    serial = [step(t) for t in range(THREADS)]

    def body(t):
        got = step(t)
        for i, (a, b) in enumerate(zip(got, serial[t])):
            assert _bitwise_equal(a, b), f"gradient {i} differs from the serial run"

    _in_threads(body)


def test_errors_raised_in_threads_carry_their_own_values():
    def body(t):
        x_norm, gy = torch.rand(4, 8), torch.randn(4, 2)
        idx = torch.zeros(4, 2, dtype=torch.int32)
        for i in range(50):
            norm_type = 1000 + 100 * t + i
            with pytest.raises(moegrad.MoeError) as info:
                moegrad.moe_gating_top_k_backward(x_norm, gy, idx, norm_type=norm_type)
            assert f"got {norm_type}" in str(info.value), str(info.value)
            assert info.value.code == 161002
            moegrad.moe_gating_top_k_backward(x_norm, gy, idx)  # and success in between

    _in_threads(body)
