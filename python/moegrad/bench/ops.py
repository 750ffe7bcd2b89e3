"""The benchmark's measurements: model shapes, cases, byte counts, interleaved timing, the
streaming-roof probe (roof.py), the per-case run, the T=16 call-overhead mode and the re-measuring
and probing passes. Method: the package docstring (moegrad.bench) and docs/performance.md.
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import moegrad
from moegrad import _C
from moegrad import reference_torch as ref
from moegrad.ops._registry import OPS as REGISTERED

from . import roof
from .roof import StreamProbe


# ---------------------------------------------------------------------------------------------
# Models (per-device shapes). H = model hidden size, F = expert (MoE FFN) hidden size, so the
# SwiGLU input is [T*K, 2F]. Gating attributes as the models route.
# ---------------------------------------------------------------------------------------------
MODELS: Dict[str, dict] = {
    # DeepSeek-V3: 256 routed experts, top-8, 8 groups keep 4 (group score = top-2 sum),
    # sigmoid scores + selection bias, routed_scaling_factor 2.5.
    "deepseek_v3": dict(E=256, K=8, group_count=8, k_group=4, group_select_mode=1,
                        norm_type=1, renorm=0, rsf=2.5, bias=True, H=7168, F=2048, clamp=-1.0),
    # Qwen3-235B-A22B: 128 experts, top-8, softmax + renormalised top-k (norm_topk_prob).
    "qwen3_moe": dict(E=128, K=8, group_count=1, k_group=1, group_select_mode=0,
                      norm_type=0, renorm=1, rsf=1.0, bias=False, H=4096, F=1536, clamp=-1.0),
    # Mixtral-8x7B: 8 experts, top-2 (softmax over the chosen two = softmax + renorm).
    "mixtral": dict(E=8, K=2, group_count=1, k_group=1, group_select_mode=0,
                    norm_type=0, renorm=1, rsf=1.0, bias=False, H=4096, F=14336, clamp=-1.0),
    # GPT-OSS-20B: 32 experts, top-4, clamped SwiGLU (limit 7.0).
    "gpt_oss": dict(E=32, K=4, group_count=1, k_group=1, group_select_mode=0,
                    norm_type=0, renorm=1, rsf=1.0, bias=False, H=2880, F=2880, clamp=7.0),
}

OPS = ("moe_gating_top_k", "moe_gating_top_k_backward", "moe_finalize_routing",
       "moe_finalize_routing_grad", "swiglu_group", "swiglu_group_quant_backward",
       "swiglu_group_quant", "moe_init_routing", "moe_init_routing_grad", "clipped_swiglu",
       "clipped_swiglu_grad")
BACKWARD_OPS = ("moe_gating_top_k_backward", "moe_finalize_routing_grad",
                "swiglu_group_quant_backward", "moe_init_routing_grad", "clipped_swiglu_grad")
# Ops that only some models use (the rest run for every model).
OP_MODELS = {"clipped_swiglu": ("gpt_oss",), "clipped_swiglu_grad": ("gpt_oss",)}
# Backward ops whose baselines are torch.autograd's backward of a forward formula: eager, and
# the backward graph torch.compile makes for the compiled forward (see autograd_backward).
AUTOGRAD_BASELINE = {"clipped_swiglu_grad": "clipped_swiglu"}
# Targets (docs/performance.md "Targets"): every case at TARGET_TOKENS tokens, 2 threads.
TARGET_TOKENS = 4096
TARGET_ROOF = 0.80                        # of the streaming roof (roof.py); not ROOF_EXEMPT
TARGET_COPY = 0.70                        # of the copy bandwidth: runs before the roof existed
ROOF_EXEMPT = ("moe_gating_top_k",)       # compute-bound: reported in cycles per token instead
TARGET_EAGER_BWD, TARGET_COMPILE_BWD, TARGET_COMPILE_FWD = 4.0, 1.5, 1.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FULL_TOKENS = (1, 16, 256, 1024, 4096, 16384)
MAX_SETS = 4096               # rotation cap (tiny cases stay warm; see module docstring)
DEFAULT_LLC = 64 << 20        # when the cache size cannot be read
DEFAULT_MEM_LIMIT_GB = 6.0    # skip cases whose estimated footprint exceeds this

# ---------------------------------------------------------------------------------------------
# Bytes that must move: every input read once, every output written once.
# s = element size of the case dtype (fp32 4, bf16/fp16 2); indices int32 (4), group_index
# int64 (8); fp32 tensors by contract: x_norm/norm_out (gating), weight/grad_weight (SwiGLU).
# M = T tokens, N = E experts, K = top-k, R = T tokens, H = hidden, Tk = T*K expanded rows,
# F = expert hidden (SwiGLU x is [Tk, 2F]), G = E groups in group_index.
# Checked against the actual tensors of every case (sum of nbytes).
# ---------------------------------------------------------------------------------------------
BYTES: Dict[str, Tuple[str, Callable[..., int]]] = {
    "moe_gating_top_k": (
        "x M*N*s + bias N*s (DeepSeek) + y M*K*s + expert_idx M*K*4 + norm_out M*N*4",
        lambda M, N, K, s, has_bias, **_: M * N * s + (N * s if has_bias else 0)
        + M * K * s + M * K * 4 + M * N * 4),
    "moe_gating_top_k_backward": (
        "x_norm M*N*4 + grad_y M*K*s + expert_idx M*K*4 + grad_x M*N*s",
        lambda M, N, K, s, **_: M * N * 4 + M * K * s + M * K * 4 + M * N * s),
    "moe_finalize_routing": (
        "expanded_x R*K*H*s + expanded_row_idx R*K*4 + x1 R*H*s + scales R*K*s + out R*H*s",
        lambda R, K, H, s, **_: R * K * H * s + R * K * 4 + R * H * s + R * K * s + R * H * s),
    "moe_finalize_routing_grad": (
        "grad_y R*H*s + expanded_row_idx R*K*4 + expanded_x R*K*H*s + scales R*K*s"
        " + grad_expanded_x R*K*H*s + grad_scales R*K*s",
        lambda R, K, H, s, **_: R * H * s + R * K * 4 + 2 * R * K * H * s + 2 * R * K * s),
    "swiglu_group": (
        "x Tk*2F*s + weight Tk*4 + group_index G*8 + y Tk*F*s",
        lambda Tk, F, G, s, **_: Tk * 2 * F * s + Tk * 4 + G * 8 + Tk * F * s),
    "swiglu_group_quant_backward": (
        "grad_y Tk*F*s + x Tk*2F*s + weight Tk*4 + y_origin Tk*F*s + group_index G*8"
        " + grad_x Tk*2F*s + grad_weight Tk*4",
        lambda Tk, F, G, s, **_: Tk * F * s + Tk * 2 * F * s + Tk * 4 + Tk * F * s + G * 8
        + Tk * 2 * F * s + Tk * 4),
    # FP8 blocks of 128 (quant_mode 0, e4m3fn): one code byte per element, an fp32 scale per
    # 128 elements of a row; no y_origin (L28).
    "swiglu_group_quant": (
        "x Tk*2F*s + weight Tk*4 + group_index G*8 + y Tk*F*1 + y_scale Tk*ceil(F/128)*4",
        lambda Tk, F, G, s, **_: Tk * 2 * F * s + Tk * 4 + G * 8 + Tk * F
        + Tk * ((F + 127) // 128) * 4),
    # The GPT-OSS activation (clamp mode 0, interleaved, no group_index).
    "clipped_swiglu": ("x Tk*2F*s + y Tk*F*s", lambda Tk, F, s, **_: 3 * Tk * F * s),
    "clipped_swiglu_grad": ("grad_y Tk*F*s + x Tk*2F*s + grad_x Tk*2F*s",
                            lambda Tk, F, s, **_: 5 * Tk * F * s),
    "moe_init_routing": (
        "x R*H*s + expert_idx R*K*4 + expanded_x R*K*H*s + expanded_row_idx R*K*4 + counts N*8",
        lambda R, K, H, N, s, **_: R * H * s + R * K * 4 + R * K * H * s + R * K * 4 + N * 8),
    "moe_init_routing_grad": (
        "grad_expanded_x R*K*H*s + expanded_row_idx R*K*4 + grad_x R*H*s",
        lambda R, K, H, s, **_: R * K * H * s + R * K * 4 + R * H * s),
}

# Peak memory of the eager formula's temporaries, in multiples of the case's bytes as if every
# floating tensor were fp32 (peak RSS of the eager call measured at DeepSeek-V3 T=1024, rounded
# up). Used only to decide which cases to skip.
EAGER_TEMP_FACTOR = {
    "moe_gating_top_k": 4.0, "moe_gating_top_k_backward": 3.5, "moe_finalize_routing": 0.6,
    "moe_finalize_routing_grad": 0.8, "swiglu_group": 1.4, "swiglu_group_quant_backward": 2.3,
    "swiglu_group_quant": 3.0,
    "moe_init_routing": 1.6, "moe_init_routing_grad": 1.2,
    "clipped_swiglu": 2.0, "clipped_swiglu_grad": 4.0,
}


# ---------------------------------------------------------------------------------------------
# Machine facts
# ---------------------------------------------------------------------------------------------
def _parse_size(text: str) -> int:
    text = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


def llc_bytes() -> Tuple[int, str]:
    """Size of the last-level cache: sysfs, then lscpu, then DEFAULT_LLC."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = (0, 0)
    try:
        for entry in sorted(os.listdir(base)):
            if not entry.startswith("index"):
                continue
            d = os.path.join(base, entry)
            with open(os.path.join(d, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(d, "level")) as f:
                level = int(f.read())
            with open(os.path.join(d, "size")) as f:
                size = _parse_size(f.read())
            best = max(best, (level, size))
    except (OSError, ValueError):
        pass
    if best[1]:
        return best[1], f"sysfs L{best[0]}"
    try:
        import subprocess
        out = subprocess.run(["lscpu", "-B"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("L3 cache:"):
                return int(line.split(":")[1].split()[0]), "lscpu L3"
    except (OSError, ValueError, IndexError, Exception):  # noqa: BLE001 - best effort
        pass
    return DEFAULT_LLC, "default"


def copy_bandwidth_gbps(threads: int, llc: int, allocations: int = 5, reps: int = 7) -> float:
    """GB/s of dst.copy_(src), buffers of max(256 MB, 4 x LLC), counted 2 x size (read + write).

    The bandwidth a buffer gets depends on where its pages land (it varies by +-20 % between
    allocations on the development VM), so this is the median over `allocations` fresh buffer
    pairs of the median of `reps` copies each -- the placement a kernel's buffers typically get.
    """
    torch.set_num_threads(threads)
    nbytes = max(256 << 20, 4 * llc)
    per_alloc = []
    for _ in range(allocations):
        src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src).fill_(0.0)
        for _ in range(2):
            dst.copy_(src)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        per_alloc.append(2 * nbytes / statistics.median(times) / 1e9)
        del src, dst
    return statistics.median(per_alloc)


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
@dataclass
class Case:
    op: str
    model: str
    dtype: str
    tokens: int
    dims: Dict[str, int]
    desc: str
    bytes: int
    bytes_f32: int                    # the same case if every floating tensor were fp32
    make: Callable[[torch.Generator], "CaseData"]


@dataclass
class CaseData:
    """One buffer set: the public call's args, the native call's args (outputs preallocated)."""
    api_args: tuple
    api_kwargs: dict
    native_args: tuple                # inputs, attributes, outputs: _C.<op>(*native_args)
    native_outputs: Tuple[Optional[Tensor], ...]
    ref_args: tuple
    ref_kwargs: dict


def _randn(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _group_counts(total: int, groups: int, g: torch.Generator) -> Tensor:
    owner = torch.randint(groups, (total,), generator=g)
    return torch.bincount(owner, minlength=groups).to(torch.int64)


def build_case(op: str, model: str, dtype_name: str, tokens: int) -> Case:
    m = MODELS[model]
    dt = DTYPES[dtype_name]
    s = torch.empty((), dtype=dt).element_size()
    E, K, H, F = m["E"], m["K"], m["H"], m["F"]
    T = tokens
    if op == "moe_gating_top_k":
        dims = dict(M=T, N=E, K=K, s=s, has_bias=m["bias"])
        desc = f"x[{T},{E}] k={K}" + (f" g{m['k_group']}/{m['group_count']}"
                                      if m["group_count"] > 1 else "")
        out_flag = m["norm_type"] == 1
        attrs = (K, m["k_group"], m["group_count"], m["group_select_mode"], m["renorm"],
                 m["norm_type"], out_flag, m["rsf"], 1e-20)

        def make(g):
            x = _randn((T, E), dt, g)
            bias = _randn((E,), dt, g, 0.1) if m["bias"] else None
            y = torch.empty((T, K), dtype=dt)
            idx = torch.empty((T, K), dtype=torch.int32)
            norm = torch.empty((T, E), dtype=torch.float32)
            kw = dict(bias=bias, k_group=attrs[1], group_count=attrs[2],
                      group_select_mode=attrs[3], renorm=attrs[4], norm_type=attrs[5],
                      out_flag=attrs[6], routed_scaling_factor=attrs[7], eps=attrs[8])
            return CaseData((x, K), kw, (x, bias) + attrs + (y, idx, norm), (y, idx, norm),
                            (x, K), kw)
    elif op == "moe_gating_top_k_backward":
        dims = dict(M=T, N=E, K=K, s=s)
        desc = f"x_norm[{T},{E}] k={K}"
        attrs = (0, 1, m["rsf"], 1e-20)

        def make(g):
            x_norm = torch.sigmoid(torch.randn((T, E), generator=g))
            grad_y = _randn((T, K), dt, g)
            idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices.to(torch.int32)
            grad_x = torch.empty((T, E), dtype=dt)
            kw = dict(renorm=0, norm_type=1, routed_scaling_factor=m["rsf"], eps=1e-20)
            return CaseData((x_norm, grad_y, idx), kw, (x_norm, grad_y, idx) + attrs + (grad_x,),
                            (grad_x,), (x_norm, grad_y, idx), kw)
    elif op == "moe_finalize_routing":
        dims = dict(R=T, K=K, H=H, s=s)
        desc = f"ex[{T * K},{H}] R={T} k={K}"

        def make(g):
            ex = _randn((T * K, H), dt, g)
            idx = torch.randperm(T * K, generator=g).to(torch.int32)  # column layout, mode 0
            x1 = _randn((T, H), dt, g)
            scales = torch.rand((T, K), generator=g).to(dt)
            out = torch.empty((T, H), dtype=dt)
            kw = dict(x1=x1, scales=scales, drop_pad_mode=0)
            return CaseData((ex, idx), kw, (ex, idx, x1, None, None, scales, None, 0, out),
                            (out,), (ex, idx), kw)
    elif op == "moe_finalize_routing_grad":
        dims = dict(R=T, K=K, H=H, s=s)
        desc = f"gy[{T},{H}] ex[{T * K},{H}] k={K}"

        def make(g):
            gy = _randn((T, H), dt, g)
            idx = torch.randperm(T * K, generator=g).to(torch.int32)  # row layout
            ex = _randn((T * K, H), dt, g)
            scales = torch.rand((T, K), generator=g).to(dt)
            gex = torch.empty((T * K, H), dtype=dt)
            gsc = torch.empty((T, K), dtype=dt)
            kw = dict(expanded_x=ex, scales=scales, drop_pad_mode=0)
            return CaseData((gy, idx), kw, (gy, idx, ex, scales, None, None, 0, 0, 0, 0, gex, gsc),
                            (gex, gsc), (gy, idx), kw)
    elif op == "swiglu_group":
        Tk = T * K
        dims = dict(Tk=Tk, F=F, G=E, s=s)
        desc = f"x[{Tk},{2 * F}]" + (f" clamp={m['clamp']:g}" if m["clamp"] > 0 else "")
        clamp = m["clamp"]

        def make(g):
            x = _randn((Tk, 2 * F), dt, g, 2.0 if clamp > 0 else 1.0)
            w = torch.rand((Tk,), generator=g)
            gi = _group_counts(Tk, E, g)
            y = torch.empty((Tk, F), dtype=dt)
            kw = dict(weight=w, group_index=gi, clamp_limit=clamp)
            return CaseData((x,), kw, (x, w, gi, clamp, y), (y,), (x,), kw)
    elif op == "swiglu_group_quant_backward":
        Tk = T * K
        dims = dict(Tk=Tk, F=F, G=E, s=s)
        desc = f"x[{Tk},{2 * F}]" + (f" clamp={m['clamp']:g}" if m["clamp"] > 0 else "")
        clamp = m["clamp"]

        def make(g):
            gy = _randn((Tk, F), dt, g)
            x = _randn((Tk, 2 * F), dt, g, 2.0 if clamp > 0 else 1.0)
            w = torch.rand((Tk,), generator=g)
            yo = _randn((Tk, F), dt, g)
            gi = _group_counts(Tk, E, g)
            gx = torch.empty((Tk, 2 * F), dtype=dt)
            gw = torch.empty((Tk,), dtype=torch.float32)
            kw = dict(weight=w, y_origin=yo, group_index=gi, clamp_limit=clamp)
            return CaseData((gy, x), kw, (gy, x, w, yo, gi, clamp, gx, gw), (gx, gw), (gy, x), kw)
    elif op == "swiglu_group_quant":
        Tk = T * K
        dims = dict(Tk=Tk, F=F, G=E, s=s)
        desc = f"x[{Tk},{2 * F}] fp8/128" + (f" clamp={m['clamp']:g}" if m["clamp"] > 0 else "")
        clamp = m["clamp"]

        def make(g):
            x = _randn((Tk, 2 * F), dt, g, 2.0 if clamp > 0 else 1.0)
            w = torch.rand((Tk,), generator=g)
            gi = _group_counts(Tk, E, g)
            y = torch.empty((Tk, F), dtype=torch.float8_e4m3fn)
            ys = torch.empty((Tk, (F + 127) // 128), dtype=torch.float32)
            kw = dict(weight=w, group_index=gi, clamp_limit=clamp)
            # The native call writes y through a uint8 view (float8 does not cross DLPack).
            return CaseData((x,), kw, (x, w, gi, None, 36, 0, 0, False, clamp, 15.0, False,
                                       y.view(torch.uint8), ys, None), (y, ys), (x,), kw)
    elif op in ("clipped_swiglu", "clipped_swiglu_grad"):
        Tk = T * K
        dims = dict(Tk=Tk, F=F, s=s)
        desc = f"x[{Tk},{2 * F}] limit=7 interleaved"
        kw = dict(alpha=1.702, limit=7.0, bias=1.0, interleaved=True)   # GPT-OSS
        native_attrs = (-1, 1.702, 7.0, 1.0, True, 0)

        def make(g):
            x = _randn((Tk, 2 * F), dt, g, 4.0)  # beyond +-7 often: the clamps act
            if op == "clipped_swiglu":
                y = torch.empty((Tk, F), dtype=dt)
                return CaseData((x,), kw, (x, None) + native_attrs + (y,), (y,), (x,), kw)
            gy = _randn((Tk, F), dt, g)
            gx = torch.empty((Tk, 2 * F), dtype=dt)
            return CaseData((gy, x), kw, (gy, x, None) + native_attrs + (gx,), (gx,), (gy, x),
                            kw)
    elif op == "moe_init_routing":
        dims = dict(R=T, K=K, H=H, N=E, s=s)
        desc = f"x[{T},{H}] k={K} E={E}"

        def make(g):
            x = _randn((T, H), dt, g)
            eidx = torch.rand((T, E), generator=g).topk(K, dim=1).indices.to(torch.int32)
            ex = torch.empty((T * K, H), dtype=dt)
            idx = torch.empty((T * K,), dtype=torch.int32)
            cnt = torch.empty((E,), dtype=torch.int64)
            kw = dict(expert_num=E)
            return CaseData((x, eidx), kw, (x, eidx, 0, 0, E, 0, 1, True, False, 0, 0, 0,
                                            ex, idx, cnt), (ex, idx, cnt), (x, eidx), kw)
    elif op == "moe_init_routing_grad":
        dims = dict(R=T, K=K, H=H, s=s)
        desc = f"gex[{T * K},{H}] k={K}"

        def make(g):
            gex = _randn((T * K, H), dt, g)
            idx = torch.randperm(T * K, generator=g).to(torch.int32)  # src->dst, row layout
            gx = torch.empty((T, H), dtype=dt)
            return CaseData((gex, idx, K), {}, (gex, idx, K, 0, 0, gx), (gx,), (gex, idx, K), {})
    else:
        raise ValueError(f"unknown op {op!r}")
    nbytes = BYTES[op][1](**dims)
    nbytes_f32 = BYTES[op][1](**dict(dims, s=4))
    dims_public = {k: v for k, v in dims.items() if k not in ("s", "has_bias")}
    dims_public["T"] = T
    return Case(op, model, dtype_name, T, dims_public, desc, nbytes, nbytes_f32, make)


def tensors_nbytes(data: CaseData) -> int:
    """Sum of nbytes of every tensor the native call reads or writes (checks the BYTES table)."""
    return sum(a.numel() * a.element_size() for a in data.native_args if isinstance(a, Tensor))


def clone_set(data: CaseData) -> CaseData:
    """A second buffer set with the same values at new addresses."""
    memo: Dict[int, Tensor] = {}

    def c(a):
        if isinstance(a, Tensor):
            if id(a) not in memo:
                memo[id(a)] = a.clone()
            return memo[id(a)]
        return a

    native = tuple(c(a) for a in data.native_args)
    return CaseData(tuple(c(a) for a in data.api_args),
                    {k: c(v) for k, v in data.api_kwargs.items()}, native,
                    tuple(c(a) for a in data.native_outputs),
                    tuple(c(a) for a in data.ref_args),
                    {k: c(v) for k, v in data.ref_kwargs.items()})


# ---------------------------------------------------------------------------------------------
# Correctness check (once per case, before timing)
# ---------------------------------------------------------------------------------------------
_CHECK_TOL = {  # sanity check against the eager formula; the tests own the real accuracy bounds
    torch.float32: dict(rtol=1e-4, atol_frac=1e-5),
    torch.float16: dict(rtol=2e-3, atol_frac=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol_frac=1e-2),
    torch.int32: dict(rtol=0.0, atol_frac=0.0),
    torch.int64: dict(rtol=0.0, atol_frac=0.0),
}


def _close(name: str, got: Tensor, want: Tensor) -> Optional[str]:
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype} != {want.dtype}"
    tol = _CHECK_TOL[want.dtype]
    amax = float(want.float().abs().max()) if want.numel() else 0.0
    try:
        torch.testing.assert_close(got, want, rtol=tol["rtol"],
                                   atol=tol["atol_frac"] * max(amax, 1e-30), equal_nan=True)
    except AssertionError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return f"{name}: " + "; ".join(lines[:3])
    return None


def check_outputs(op: str, data: CaseData, got: tuple, want: tuple) -> str:
    """'ok' or a short description of the first mismatch."""
    if op == "moe_gating_top_k":
        # Near-ties may legitimately order differently (torch.topk is not stable): check that
        # moegrad's choice scores as high as the reference's, then y at moegrad's choice.
        y, idx, norm = got
        y_ref, idx_ref, norm_ref = want
        kw = data.ref_kwargs
        x = data.ref_args[0]
        nrm = ref._normalise(x.float(), kw["norm_type"])
        score = nrm if kw["bias"] is None else nrm + kw["bias"].float()
        problems = [
            _close("norm_out", norm, norm_ref),
            _close("selected scores", score.gather(1, idx.long()).sort(dim=1).values,
                   score.gather(1, idx_ref.long()).sort(dim=1).values),
            _close("y", y, ref.gating_weights(nrm, idx, kw["renorm"], kw["norm_type"],
                                              kw["routed_scaling_factor"], kw["eps"], x.dtype)),
        ]
    elif op == "swiglu_group_quant":
        # Scales as fp32 values; codes compared after dequantisation (one FP8 step apart where
        # the eager fp32 product rounds the other way).
        y, ys = got[0], got[1]
        y_ref, ys_ref = want[0], want[1]
        problems = [_close("y_scale", ys, ys_ref)]
        step = ys.float().repeat_interleave(128, dim=-1)[..., :y.shape[-1]]
        err = (y.float() - y_ref.float()).abs() * step
        lim = 0.13 * y_ref.float().abs() * step + 1e-30 + 2.0 ** -9 * step
        if not bool((err <= lim).all()):
            problems.append(f"y: {int((err > lim).sum())} codes more than one FP8 step off")
    else:
        names = {"moe_gating_top_k_backward": ("grad_x",),
                 "moe_finalize_routing": ("out",),
                 "moe_finalize_routing_grad": ("grad_expanded_x", "grad_scales"),
                 "swiglu_group": ("y",),
                 "swiglu_group_quant_backward": ("grad_x", "grad_weight"),
                 "moe_init_routing": ("expanded_x", "expanded_row_idx", "counts"),
                 "moe_init_routing_grad": ("grad_x",),
                 "clipped_swiglu": ("y",), "clipped_swiglu_grad": ("grad_x",)}[op]
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        problems = [_close(n, a, b) for n, a, b in zip(names, got, want)]
    problems = [p for p in problems if p]
    return "ok" if not problems else "MISMATCH " + " | ".join(problems)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
@dataclass
class Budget:
    min_calls: int = 5
    max_calls: int = 2000
    seconds: float = 0.25          # per method per case, after warm-up
    warmup_calls: int = 3


class _Method:
    """Timing state of one method: its buffer-set calls, rotation index, call times."""

    def __init__(self, fns: Sequence[Callable[[], object]], budget: Budget):
        self.fns, self.i, self.times = list(fns), 0, []
        t0 = time.perf_counter()
        self.fns[0]()
        first = time.perf_counter() - t0
        self.i = 1
        self.slow = first > budget.seconds
        warm = 1 if self.slow else max(budget.warmup_calls, min(len(self.fns), 64))
        for _ in range(warm - 1):
            self.call()

    def call(self) -> float:
        f = self.fns[self.i % len(self.fns)]
        self.i += 1
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0


def time_interleaved(methods: Dict[str, Sequence[Callable[[], object]]], budget: Budget,
                     probe: Optional[StreamProbe], rounds: int) -> Tuple[Dict[str, float],
                                                                         List[dict]]:
    """Median seconds per call of every method, and bandwidth samples (`probe.measure`: the
    streaming roof's read, write and copy, roof.py), all taken in one
    time window (the VM's memory bandwidth drifts by tens of percent within minutes, so numbers
    that are divided by each other must be measured together).

    Each method rotates through its list of calls (one per buffer set). Warm-up: one pass over
    the sets (at most 64 calls, at least `warmup_calls`; one call when a call takes longer than
    the budget). Then `rounds` rounds; a round takes one bandwidth sample (when `probe` is given),
    then gives every method in turn its share of the budget: one untimed lead-in call (not for
    calls slower than the budget), then calls until both ceil(min_calls / rounds) (one for
    calls slower than the budget) and seconds / rounds are reached, or max_calls / rounds. One
    more sample closes the window. The lead-in makes each timed call follow a call of its
    own method, as an op's calls follow each other in a training loop, instead of the state
    another method's long call left behind: on a VM that hands free memory back to its host,
    a fresh output's pages cost several times the op itself right after an eager call of a
    few seconds (docs/decisions.md L139).
    Returns ({name: median seconds}, [samples])."""
    state = {name: _Method(fns, budget) for name, fns in methods.items()}
    samples: List[dict] = []
    per_round_s = budget.seconds / rounds
    for _ in range(rounds):
        if probe is not None:
            samples.append(probe.measure(reps=3))
        for m in state.values():
            if not m.slow:
                m.call()  # the lead-in, untimed
            need = 1 if m.slow else math.ceil(budget.min_calls / rounds)
            cap = max(need, budget.max_calls // rounds)
            start = time.perf_counter()
            n = 0
            while n < need or (n < cap and time.perf_counter() - start < per_round_s):
                m.times.append(m.call())
                n += 1
    if probe is not None:
        samples.append(probe.measure(reps=3))
    for m in state.values():  # slow methods: at least 3 calls in all
        while len(m.times) < 3:
            m.times.append(m.call())
    return {name: statistics.median(m.times) for name, m in state.items()}, samples


def n_sets_for(nbytes: int, llc: int, max_sets: int) -> int:
    """Buffer sets so that the rotation touches >= 4 x LLC (at least 2 below 8 x LLC)."""
    n = math.ceil(4 * llc / max(nbytes, 1))
    if nbytes < 8 * llc:
        n = max(n, 2)
    return max(1, min(n, max_sets))


def estimate_memory(case: Case, n_sets: int, with_eager: bool) -> int:
    est = case.bytes * n_sets            # buffer sets (inputs + preallocated outputs)
    est += case.bytes // 2               # outputs of the public / compiled call in flight
    if with_eager:
        est += int(EAGER_TEMP_FACTOR[case.op] * case.bytes_f32)
    return est


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def _fmt_ms(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _fmt_x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}x"


HEADER = (f"{'op':<28} {'model':<12} {'dt':<4} {'T':>6} {'shape':<30} {'MB':>8} "
          f"{'moegrad':>9} {'kernel':>9} {'eager':>9} {'compile':>9} {'GB/s':>6} "
          f"{'copy':>5} {'roof':>5} {'copyf':>5} {'vs eag':>7} {'vs cmp':>7}  check")


def format_row(r: dict) -> str:
    return (f"{r['op']:<28} {r['model']:<12} {r['dtype']:<4} {r['shape']['T']:>6} "
            f"{r['desc']:<30} {r['bytes'] / 1e6:>8.2f} {_fmt_ms(r['ms_moegrad']):>9} "
            f"{_fmt_ms(r['ms_kernel']):>9} {_fmt_ms(r['ms_eager']):>9} "
            f"{_fmt_ms(r['ms_compile']):>9} {r['gbps']:>6.1f} {r['copy_gbps']:>5.1f} "
            f"{_fmt_frac(r.get('roof_frac')):>5} {r['roofline_frac']:>5.2f} "
            f"{_fmt_x(r['speedup_eager']):>7} {_fmt_x(r['speedup_compile']):>7}  {r['check']}")


def _fmt_frac(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def roof_met(r: dict) -> bool:
    """The memory-bound target: roof_frac >= TARGET_ROOF, or for a record of a run before the
    streaming roof (no roof_frac), the copy fraction >= TARGET_COPY."""
    if r.get("roof_frac") is not None:
        return r["roof_frac"] >= TARGET_ROOF
    return r["roofline_frac"] >= TARGET_COPY


def target_checks(r: dict) -> Dict[str, Optional[bool]]:
    """Which targets a T = TARGET_TOKENS record meets (None: not applicable or not measured)."""
    bwd = r["op"] in BACKWARD_OPS
    cmp_ = r.get("speedup_compile")
    return dict(
        roofline=None if r["op"] in ROOF_EXEMPT else roof_met(r),
        eager=(r["speedup_eager"] >= TARGET_EAGER_BWD) if bwd else None,
        compile=None if cmp_ is None else cmp_ >= (TARGET_COMPILE_BWD if bwd
                                                   else TARGET_COMPILE_FWD))


def autograd_backward(forward: Callable) -> Callable:
    """grad(grad_y, x, group_index=None, **attrs) -> grad_x by torch.autograd through `forward`
    (eager, or a torch.compile'd function, whose backward is then the compiled backward graph).
    The forward's graph is built once per x and retained, so a call times the backward alone,
    as in a training step."""
    graphs: Dict[int, Tuple[Tensor, Tensor, Tensor]] = {}

    def grad(grad_y: Tensor, x: Tensor, group_index: Optional[Tensor] = None, **attrs) -> Tensor:
        if id(x) not in graphs:
            with torch.enable_grad():
                xl = x.detach().requires_grad_(True)
                graphs[id(x)] = (x, xl, forward(xl, group_index, **attrs))
        _, xl, y = graphs[id(x)]
        return torch.autograd.grad(y, xl, grad_y, retain_graph=True)[0]

    return grad


def run_case(case: Case, args, llc: int, copy_gbps: float, seed: int,
             do_compile: bool, budget: Budget, probe: Optional[StreamProbe] = None,
             rounds: int = 1) -> dict:
    """One case: build the buffer sets, check the outputs once, then time the public op, the
    kernel, eager and compile interleaved with streaming-roof samples of `probe` (roof.py).
    The record's `copy_gbps` is the median of the samples' Tensor.copy_ (`copy_gbps` argument
    when no probe), `roofline_frac` the kernel's bytes per second over it; `roof_frac` =
    `ms_roof` / `ms_kernel`, `ms_roof` the case's read bytes at the samples' median read
    bandwidth plus its write bytes at their write bandwidth (None without a probe). The
    compute-bound ops (ROOF_EXEMPT) get `cycles_per_token` at the measured clock."""
    g = torch.Generator().manual_seed(seed)
    base = case.make(g)
    actual = tensors_nbytes(base)
    if actual != case.bytes:
        raise AssertionError(f"BYTES table of {case.op} says {case.bytes}, tensors hold {actual}")
    n_sets = n_sets_for(case.bytes, llc, args.max_sets)
    sets = [base] + [clone_set(base) for _ in range(n_sets - 1)]

    api = getattr(moegrad, case.op)
    native = getattr(_C, case.op)
    fwd = AUTOGRAD_BASELINE.get(case.op)
    eager = autograd_backward(getattr(ref, fwd)) if fwd else getattr(ref, case.op)

    # ---- correctness, once ----
    got = api(*base.api_args, **base.api_kwargs)
    want = eager(*base.ref_args, **base.ref_kwargs)
    check = check_outputs(case.op, base, got, want)
    native(*base.native_args)
    outs = base.native_outputs
    got_native = outs if len(outs) > 1 else outs[0]
    native_check = check_outputs(case.op, base, got_native, want)
    if native_check != "ok" and check == "ok":
        check = "native " + native_check
    compiled = None
    check_compile = None
    if do_compile:
        torch._dynamo.reset()
        if fwd:
            compiled = autograd_backward(torch.compile(getattr(ref, fwd), dynamic=False))
        else:
            compiled = torch.compile(eager, dynamic=False)
        try:
            got_c = compiled(*base.ref_args, **base.ref_kwargs)
            check_compile = check_outputs(case.op, base, got_c, want)
        except Exception as e:  # noqa: BLE001 - report and go on
            check_compile = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            compiled = None
    del got, want

    # ---- timing: every method and the copy bandwidth in one interleaved window ----
    methods = {
        "api": [functools.partial(api, *d.api_args, **d.api_kwargs) for d in sets],
        "kernel": [functools.partial(native, *d.native_args) for d in sets],
        "eager": [functools.partial(eager, *d.ref_args, **d.ref_kwargs) for d in sets],
    }
    if compiled is not None:
        methods["compile"] = [functools.partial(compiled, *d.ref_args, **d.ref_kwargs)
                              for d in sets]
    med, samples = time_interleaved(methods, budget, probe, rounds)
    ms_api, ms_kernel, ms_eager = (1e3 * med[k] for k in ("api", "kernel", "eager"))
    ms_compile = 1e3 * med["compile"] if "compile" in med else None
    bw = roof.median_sample(samples)
    copy_gbps = bw.get("torch_copy", copy_gbps)
    read_bytes, write_bytes = roof.split_bytes(base.native_args, base.native_outputs)
    ms_roof = 1e3 * roof.roof_seconds(read_bytes, write_bytes, bw) if bw else None
    extra = {}
    if case.op in ROOF_EXEMPT:
        ghz = roof.clock_ghz()
        extra = dict(clock_ghz=ghz,
                     cycles_per_token=roof.cycles_per_token(ms_kernel, case.tokens,
                                                            args.threads, ghz))
    gbps = case.bytes / (ms_kernel * 1e-3) / 1e9
    return dict(extra,
        op=case.op, model=case.model, dtype=case.dtype, shape=case.dims, desc=case.desc,
        bytes=case.bytes, ms_moegrad=ms_api, ms_kernel=ms_kernel, ms_eager=ms_eager,
        ms_compile=ms_compile, gbps=gbps, gbps_api=case.bytes / (ms_api * 1e-3) / 1e9,
        roofline_frac=gbps / copy_gbps, speedup_eager=ms_eager / ms_api,
        speedup_compile=(ms_compile / ms_api) if ms_compile is not None else None,
        threads=args.threads, copy_gbps=copy_gbps,
        copy_samples=[s["torch_copy"] for s in samples], read_gbps=bw.get("read"),
        write_gbps=bw.get("write"), stream_copy_gbps=bw.get("copy"), read_bytes=read_bytes,
        write_bytes=write_bytes, ms_roof=ms_roof,
        roof_frac=None if ms_roof is None else ms_roof / ms_kernel, n_sets=n_sets,
        cold=case.bytes * n_sets >= 2 * llc, check=check, check_compile=check_compile)


def select_cases(args) -> List[Tuple[Case, bool]]:
    """(case, compile it?) in run order."""
    out: List[Tuple[Case, bool]] = []
    # plan: model -> (token counts, dtypes)
    if args.tiny:
        plan = {"deepseek_v3": ((1, 16), ("bf16",)), "gpt_oss": ((16,), ("bf16",))}
    elif args.quick:
        plan = {"deepseek_v3": ((1024,), ("bf16", "fp32")), "gpt_oss": ((16, 256), ("bf16",))}
    else:
        plan = {m: (FULL_TOKENS, ("bf16", "fp32")) for m in MODELS}
    if args.models:  # a model outside the mode's plan gets the plan's first sizes
        plan = {m: plan.get(m, next(iter(plan.values()))) for m in args.models}
    for op in args.ops:
        for model, (tokens, dtypes) in plan.items():
            if model not in OP_MODELS.get(op, (model,)):
                continue
            for t in (args.tokens or tokens):
                for dt in (args.dtypes or dtypes):
                    case = build_case(op, model, dt, t)
                    if args.no_compile:
                        comp = False
                    elif args.quick:  # compile time counts: one dtype, the larger shapes
                        comp = dt == "bf16" and t >= 1024
                    else:
                        comp = True
                    out.append((case, comp))
    return out


# ---------------------------------------------------------------------------------------------
# Per-call overhead at T=16 (--overhead)
# ---------------------------------------------------------------------------------------------
OVERHEAD_VARIANTS = ("public", "custom_op", "library", "body", "eager")
_MIRRORS = None


def mirror_ops(names: Sequence[str]):
    """The public ops' bodies registered twice more, in private namespaces: once with
    torch.library.custom_op, once with torch.library.Library define/impl plus register_fake and
    register_autograd, so both registration styles are timed side by side on the same code.
    Returns {name: (custom_op packet, library packet)}."""
    global _MIRRORS
    if _MIRRORS is None:
        _MIRRORS = (torch.library.Library("moegrad_ovh_lib", "DEF"), {})
    lib, out = _MIRRORS
    for name in names:
        if name in out:
            continue
        op = REGISTERED[name]
        body = getattr(op, "_init_fn", None) or getattr(op, "_body")
        fake, bwd = op._abstract_fn, op._backward_fn
        setup = op._setup_context_fn
        cop = torch.library.custom_op(f"moegrad_ovh_cop::{name}", body, mutates_args=())
        cop.register_fake(fake)
        if bwd is not None:
            cop.register_autograd(bwd, setup_context=setup)
        lib.define(name + str(op._schema))
        lib.impl(name, body, "CompositeExplicitAutograd")
        qual = f"moegrad_ovh_lib::{name}"
        torch.library.register_fake(qual, fake, lib=lib)
        if bwd is not None:
            torch.library.register_autograd(qual, bwd, setup_context=setup, lib=lib)
        out[name] = (getattr(torch.ops.moegrad_ovh_cop, name),
                     getattr(torch.ops.moegrad_ovh_lib, name))
    return out


def run_overhead(args) -> int:
    """Per-call cost of every public op at T=16 (gpt_oss shapes, bf16) against the eager
    formula, and the two torch.library registration styles on the same body. Warm (one buffer
    set): at this size the call overhead is a large part of the time. Rounds interleave the
    variants; each variant's time is the best round's mean, in microseconds."""
    tokens = args.tokens[0] if args.tokens else 16
    model = (args.models or ["gpt_oss"])[0]
    dt = (args.dtypes or ["bf16"])[0]
    rounds, calls = (2, 5) if args.tiny else (15, 100)
    ops = [op for op in args.ops if op in OPS]
    mirrors = mirror_ops(ops)
    torch.set_num_threads(args.threads)
    moegrad.set_num_threads(args.threads)
    print(f"per-call time in us at T={tokens} ({model}, {dt}, {args.threads} threads), best of "
          f"{rounds} interleaved rounds of {calls} calls; load average {os.getloadavg()[0]:.2f}")
    print(f"{'op':<28} " + " ".join(f"{v:>10}" for v in OVERHEAD_VARIANTS) + f" {'vs eager':>9}")
    records = []
    for op in ops:
        case = build_case(op, model, dt, tokens)
        d = case.make(torch.Generator().manual_seed(args.seed))
        cop, libop = mirrors[op]
        body = REGISTERED[op]._init_fn
        fns = {
            "public": functools.partial(getattr(moegrad, op), *d.api_args, **d.api_kwargs),
            "custom_op": functools.partial(cop, *d.api_args, **d.api_kwargs),
            "library": functools.partial(libop, *d.api_args, **d.api_kwargs),
            "body": functools.partial(body, *d.api_args, **d.api_kwargs),
            "eager": functools.partial(getattr(ref, op), *d.ref_args, **d.ref_kwargs),
        }
        best = {k: math.inf for k in fns}
        for f in fns.values():
            f()  # warm-up (first-call registration work)
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                best[k] = min(best[k], (time.perf_counter() - t0) / calls * 1e6)
        rec = dict(op=op, model=model, dtype=dt, tokens=tokens, threads=args.threads,
                   **{f"us_{k}": v for k, v in best.items()},
                   speedup_eager=best["eager"] / best["public"])
        records.append(rec)
        print(f"{op:<28} " + " ".join(f"{best[v]:>10.1f}" for v in OVERHEAD_VARIANTS)
              + f" {rec['speedup_eager']:>8.2f}x")
        sys.stdout.flush()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(meta=dict(mode="overhead", date=datetime.datetime.now().isoformat(
                timespec="seconds"), torch=torch.__version__, moegrad=moegrad.__version__,
                loadavg=os.getloadavg()[0]), records=records), f, indent=1)
    return 0


LOW_COPY = 0.85      # a case whose copy samples fall below this x the run's best case ...
REMEASURE = 2       # ... is measured again, at most this many times, keeping its best window


def remeasure_low_copy(records: List[dict], cases_run: List[Tuple["Case", bool]], args,
                       llc: int, budget: Budget, probe: StreamProbe, rounds: int,
                       meta: dict, budget_s: float = math.inf) -> None:
    """Measure again the cases whose window caught the VM in a low-bandwidth phase.

    The run's reference copy bandwidth is the highest of the cases' window medians (each a
    median of several samples, so one fast copy does not set it). A kernel that is not limited
    by memory keeps its speed when the VM's bandwidth drops, so its fraction of a low sample
    overstates it; a memory-bound one slows down with the copy. Cases below LOW_COPY x
    reference are run again (at the end of the run, up to REMEASURE times, while the time spent
    re-measuring stays under `budget_s`); the attempt with the highest copy bandwidth is kept,
    its `attempts` counts the runs, and `copy_low` stays true if even that one was below."""
    if not records:
        return
    ref_copy = max(r["copy_gbps"] for r in records)
    meta["copy_gbps_reference"] = ref_copy
    start = time.perf_counter()
    for attempt in range(REMEASURE):
        low = [i for i, r in enumerate(records) if r["copy_gbps"] < LOW_COPY * ref_copy]
        if not low:
            break
        print(f"re-measuring {len(low)} case(s) whose copy bandwidth was below "
              f"{LOW_COPY:.2f} x {ref_copy:.1f} GB/s (attempt {attempt + 2})")
        for i in low:
            if time.perf_counter() - start > budget_s:
                print("  re-measuring stopped: its time budget is spent")
                break
            case, comp = cases_run[i]
            old = records[i]
            try:
                rec = run_case(case, args, llc, old["copy_gbps"], args.seed, comp, budget,
                               probe, rounds)
            except Exception as e:  # noqa: BLE001 - keep the first measurement
                print(f"  {case.op} {case.model} {case.dtype}: {type(e).__name__}")
                continue
            rec["attempts"] = old["attempts"] + 1
            if rec["copy_gbps"] > old["copy_gbps"]:
                records[i] = rec
            else:
                old["attempts"] = rec["attempts"]
            print(format_row(records[i]))
    for r in records:
        r["copy_low"] = r["copy_gbps"] < LOW_COPY * ref_copy
    sys.stdout.flush()


IN_CACHE_LLC_FRACTION = 0.25   # in-cache probe: a call's bytes at most this x LLC


def in_cache_tokens(op: str, model: str, dtype: str, tokens: int, limit: int) -> int:
    """The token count, `tokens` halved until the case moves at most `limit` bytes (>= 16)."""
    t = tokens
    while t > 16 and build_case(op, model, dtype, t).bytes > limit:
        t //= 2
    return t


def roofline_misses(records: List[dict]) -> List[dict]:
    """The records at TARGET_TOKENS that miss their roofline target (the probes' subjects)."""
    return [r for r in records
            if r["shape"]["T"] == TARGET_TOKENS and target_checks(r)["roofline"] is False]


def probe_in_cache(records: List[dict], llc: int, budget: Budget, seed: int,
                   ref_copy: float) -> None:
    """The kernel's rate with its data in cache, for every record at TARGET_TOKENS that misses
    its roofline target: the same op, model and dtype at the largest halving of T whose call
    moves at most IN_CACHE_LLC_FRACTION x LLC, one buffer set, so every call finds its inputs
    in the cache. That rate is the kernel's compute alone; when it stays below TARGET_ROOF of
    the streaming roof of those bytes at the record's read and write bandwidths (records
    without them: below TARGET_COPY x `ref_copy`, the run's reference copy bandwidth) the miss
    is a compute bound, not a memory one. Stored as the record's `in_cache` (T, bytes,
    ms_kernel, gbps, compute_bound)."""
    for r in roofline_misses(records):
        t = in_cache_tokens(r["op"], r["model"], r["dtype"], r["shape"]["T"],
                            int(IN_CACHE_LLC_FRACTION * llc))
        case = build_case(r["op"], r["model"], r["dtype"], t)
        data = case.make(torch.Generator().manual_seed(seed))
        call = functools.partial(getattr(_C, case.op), *data.native_args)
        med, _ = time_interleaved({"kernel": [call]}, budget, None, 1)
        gbps = case.bytes / med["kernel"] / 1e9
        if r.get("read_gbps") and r.get("write_gbps"):
            rb, wb = roof.split_bytes(data.native_args, data.native_outputs)
            bw = dict(read=r["read_gbps"], write=r["write_gbps"])
            bound = roof.roof_seconds(rb, wb, bw) / med["kernel"] < TARGET_ROOF
        else:
            bound = gbps < TARGET_COPY * ref_copy
        r["in_cache"] = dict(T=t, bytes=case.bytes, ms_kernel=1e3 * med["kernel"], gbps=gbps,
                             compute_bound=bound)
        print(f"in cache: {r['op']} {r['model']} {r['dtype']} T={t} "
              f"{case.bytes / 1e6:.2f} MB {gbps:.1f} GB/s"
              + (" (compute-bound)" if r["in_cache"]["compute_bound"] else ""))
    sys.stdout.flush()


def same_size_copies(nbytes: int, n_sets: int) -> List[Callable[[], object]]:
    """`n_sets` fresh fp32 buffer pairs of nbytes / 2 each: dst.copy_(src) moves nbytes (2 x
    size, as the reference copy counts it), one call per pair, rotated like a case's sets."""
    n = max(1, nbytes // 8)
    return [functools.partial(torch.empty(n).copy_, torch.ones(n)) for _ in range(n_sets)]


def probe_same_size_copy(records: List[dict], llc: int, budget: Budget, seed: int,
                         rounds: int = 4) -> None:
    """For every record at TARGET_TOKENS that misses its roofline target: the kernel again,
    interleaved in one window with a plain copy of the same bytes (`same_size_copies`) through
    as many buffer sets as the case rotates through. A copy of a few hundred KB per call does
    not reach the large buffer's rate (thread start, the first misses of every stream, the
    join); `kernel_frac` = kernel / copy tells what the kernel loses beyond what any call of
    that size loses. Stored as the record's `same_size_copy` (bytes, n_sets, gbps,
    kernel_gbps, kernel_frac)."""
    for r in roofline_misses(records):
        case = build_case(r["op"], r["model"], r["dtype"], r["shape"]["T"])
        base = case.make(torch.Generator().manual_seed(seed))
        n_sets = r.get("n_sets") or n_sets_for(case.bytes, llc, MAX_SETS)
        sets = [base] + [clone_set(base) for _ in range(n_sets - 1)]
        native = getattr(_C, case.op)
        copies = same_size_copies(case.bytes, n_sets)
        med, _ = time_interleaved({"kernel": [functools.partial(native, *d.native_args)
                                              for d in sets], "copy": copies}, budget, None,
                                  rounds)
        gbps = case.bytes / med["kernel"] / 1e9
        copy = 8 * (case.bytes // 8) / med["copy"] / 1e9
        r["same_size_copy"] = dict(bytes=8 * (case.bytes // 8), n_sets=n_sets, gbps=copy,
                                   kernel_gbps=gbps, kernel_frac=gbps / copy)
        print(f"same-size copy: {r['op']} {r['model']} {r['dtype']} "
              f"{case.bytes / 1e6:.2f} MB x {n_sets} sets: copy {copy:.1f} GB/s, kernel "
              f"{gbps:.1f} GB/s ({gbps / copy:.2f} of it)")
        del sets, copies
    sys.stdout.flush()
