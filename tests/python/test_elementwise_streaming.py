"""Outputs of at least 8 MiB go out with non-temporal stores (docs/decisions.md L72), smaller ones
with plain stores: the two paths must give the same bits. Rows are independent, so a large call
and a small call on a slice of its rows must agree bit for bit on those rows (fp32, fp16, bf16;
SwiGLU forward, quantised forward with y_origin, backward), including specials and denormals.
"""
from __future__ import annotations

import pytest
import torch

import moegrad
from _util_validation import gen, randn, upstream  # noqa: F401

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
MiB = 1 << 20


def with_specials(x):
    x = x.clone()
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, -200.0])
    x[1, :3] = torch.tensor([1e-40, -1e-39, 3e-5]).to(x.dtype)  # denormal inputs (fp32)
    return x


def rows(T):
    return [slice(0, 24), slice(T // 2 - 5, T // 2 + 7), slice(T - 24, T)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_swiglu_forward_large_output_equals_small_calls(gen, dtype):
    H = 2048
    T = (8 * MiB) // (H * dtype.itemsize) + 8  # y just above the threshold
    x = with_specials(randn(gen, T, 2 * H, dtype=dtype, scale=3.0))
    w = 0.2 + torch.rand(T, generator=gen)
    for clamp in (-1.0, 7.0):
        y = moegrad.swiglu_group(x, w, clamp_limit=clamp)
        assert y.numel() * y.element_size() >= 8 * MiB
        for r in rows(T):
            small = moegrad.swiglu_group(x[r].contiguous(), w[r].contiguous(), clamp_limit=clamp)
            assert torch.equal(y[r].view(torch.int16 if dtype != torch.float32 else torch.int32),
                               small.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_swiglu_backward_large_output_equals_small_calls(gen, dtype):
    H = 2048
    T = (8 * MiB) // (2 * H * dtype.itemsize) + 8
    x = with_specials(randn(gen, T, 2 * H, dtype=dtype, scale=3.0))
    w = 0.2 + torch.rand(T, generator=gen)
    gy = upstream(gen, T, H, dtype=dtype)
    yo = moegrad.swiglu_group(x)
    gx, gw = moegrad.swiglu_group_quant_backward(gy, x, weight=w, y_origin=yo)
    ibits = torch.int16 if dtype != torch.float32 else torch.int32
    for r in rows(T):
        sgx, sgw = moegrad.swiglu_group_quant_backward(gy[r].contiguous(), x[r].contiguous(),
                                                       weight=w[r].contiguous(),
                                                       y_origin=yo[r].contiguous())
        assert torch.equal(gx[r].view(ibits), sgx.view(ibits))
        assert torch.equal(gw[r].view(torch.int32), sgw.view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode", [0, 1], ids=["fp8_128", "mx_32"])
@pytest.mark.parametrize("dst", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_swiglu_quant_large_output_equals_small_calls(gen, dtype, mode, dst):
    H = 2048
    T = (8 * MiB) // H + 8  # the codes alone pass the threshold
    x = with_specials(randn(gen, T, 2 * H, dtype=dtype, scale=3.0))
    w = 0.2 + torch.rand(T, generator=gen)
    y, s, o = moegrad.swiglu_group_quant(x, w, dst_type=dst, quant_mode=mode, round_scale=mode == 1,
                                         output_origin=True)
    ibits = torch.int16 if dtype != torch.float32 else torch.int32
    for r in rows(T):
        sy, ss, so = moegrad.swiglu_group_quant(x[r].contiguous(), w[r].contiguous(), dst_type=dst,
                                                quant_mode=mode, round_scale=mode == 1,
                                                output_origin=True)
        assert torch.equal(y[r].view(torch.uint8), sy.view(torch.uint8))
        assert torch.equal(s[r].view(torch.uint8), ss.view(torch.uint8))
        assert torch.equal(o[r].view(ibits), so.view(ibits))
