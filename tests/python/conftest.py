"""Shared fixtures and helpers of the moegrad Python tests.

* `seed` / `rng`: every test draws fresh random inputs from a seed taken from os.urandom, printed
  (shown by pytest when the test fails); set MOEGRAD_TEST_SEED=<int> to replay it.
* TOLERANCES: the ONE per-dtype tolerance table (see its comment for the model).
* poison(), assert_close_to_ref(), tie_free_logits() and small data builders.

This file deliberately does not import moegrad: test_reference.py must run without the library,
while every test module that needs the library imports it at the top and so fails (never skips)
when it is missing.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # make `import reference` work under any pytest import mode
    sys.path.insert(0, _HERE)

import reference as ref  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = ("fp32", "fp16", "bf16")
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)

# ---------------------------------------------------------------------------------------------
# The tolerance table (the only one in the suite).
#
# The kernels widen fp16/bf16 to fp32, compute in fp32 and narrow the result once with
# round-to-nearest-even (§0.4, D12); the reference computes in float64 from the same rounded
# inputs. With v the kernel's fp32 value before narrowing, |round(v) - ref| <= ulp/2 + |v - ref|,
# so an element passes when
#     |out - ref| <= atol + ulp(out dtype at |ref|) / 2 + ctol * (1 + sqrt(n_reduce)) * scale
# * ulp/2: the final round-to-nearest into the OUTPUT dtype (bits = significand bits, emin = the
#   smallest normal exponent, below which the ulp is that of the subnormals). Half an ulp, not one:
#   a truncating (round-toward-zero) narrowing errs by up to a whole ulp and is caught.
# * atol: fp32/bf16 share the fp32 exponent range; a tiny floor (1e-30) lets a kernel flush fp32
#   subnormal results to zero. fp16 subnormals are covered by the ulp term.
# * ctol: the fp32 arithmetic before the narrowing (a few fp32 ulps for exp/log/division; the
#   same for all dtypes because all compute is fp32), measured against `scale`, the magnitude of
#   the terms (sum of |terms| for reductions and for differences that cancel; |ref| by default).
#   Widened by sqrt(n_reduce) for a reduction over n_reduce terms: fp32 rounding errors of a sum
#   of random terms grow like sqrt(n) whatever the summation order (tree or sequential).
# ---------------------------------------------------------------------------------------------
TOLERANCES = {
    torch.float32: dict(bits=24, emin=-126, atol=1e-30, ctol=2e-6),
    torch.float16: dict(bits=11, emin=-14, atol=0.0, ctol=2e-6),
    torch.bfloat16: dict(bits=8, emin=-126, atol=1e-30, ctol=2e-6),
}


def unit_roundoff(dtype):
    """Largest relative error of one round-to-nearest into `dtype` (2^-bits)."""
    return 2.0 ** -TOLERANCES[dtype]["bits"]


def ulp(dtype, a):
    """Spacing of `dtype` numbers at magnitude |a| (subnormal spacing below the normal range)."""
    t = TOLERANCES[dtype]
    a = np.abs(np.asarray(a, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    e = np.maximum(e - 1, t["emin"])
    return np.ldexp(1.0, e - (t["bits"] - 1))


def tolerance(dtype, ref_abs, scale=None, n_reduce=1, out_abs=None):
    t = TOLERANCES[dtype]
    ref_abs = np.abs(np.asarray(ref_abs, dtype=np.float64))
    mag = ref_abs if out_abs is None else np.maximum(ref_abs, np.abs(out_abs))
    if scale is None:
        scale = ref_abs
    widen = 1.0 + math.sqrt(max(n_reduce, 1))
    return t["atol"] + 0.5 * ulp(dtype, mag) + t["ctol"] * widen * scale


# ---------------------------------------------------------------------------------------------
# seeds
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def seed(request):
    env = os.environ.get("MOEGRAD_TEST_SEED")
    s = int(env, 0) if env else int.from_bytes(os.urandom(4), "little")
    print(f"[{request.node.nodeid}] MOEGRAD_TEST_SEED={s}")
    return s


@pytest.fixture
def rng(seed):
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def poison(t):
    """Fill an output buffer with garbage before a low-level call: NaN for floating tensors,
    0xFF bytes (-1 for signed ints) otherwise. Returns the tensor."""
    if t is None:
        return None
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.numel():
        t.view(torch.uint8).fill_(0xFF)
    return t


def to_np(a):
    return ref.as_f64(a)


def assert_close_to_ref(out, expected, dtype=None, scale=None, n_reduce=1, what="output"):
    """Compare a library output with the float64 reference.

    `dtype` is the dtype whose rounding the output went through (default: out.dtype). `scale`
    (array broadcastable to the output) is the magnitude of the terms, see TOLERANCES. NaN and
    +-inf must appear exactly where the reference has them; so a poisoned (NaN) element that was
    never written fails here.
    """
    if dtype is None:
        dtype = out.dtype
    o = to_np(out)
    e = np.asarray(expected, dtype=np.float64)
    assert o.shape == e.shape, f"{what}: shape {o.shape} != reference {e.shape}"
    if o.size == 0:
        return
    on, en = np.isnan(o), np.isnan(e)
    bad_nan = on != en
    assert not bad_nan.any(), (
        f"{what}: NaN mismatch at {np.argwhere(bad_nan)[:5].tolist()} "
        f"(out={o[bad_nan][:5]}, ref={e[bad_nan][:5]}); {int(bad_nan.sum())} of {o.size}")
    oi, ei = np.isinf(o), np.isinf(e)
    bad_inf = (oi | ei) & ~(on | en) & (o != e)
    assert not bad_inf.any(), (
        f"{what}: inf mismatch at {np.argwhere(bad_inf)[:5].tolist()} "
        f"(out={o[bad_inf][:5]}, ref={e[bad_inf][:5]})")
    fin = ~(on | oi | ei)
    sc = None if scale is None else np.broadcast_to(np.asarray(scale, np.float64), e.shape)
    with np.errstate(invalid="ignore"):
        tol = tolerance(dtype, np.abs(e), sc, n_reduce, out_abs=np.where(fin, o, 0.0))
    with np.errstate(invalid="ignore"):
        err = np.where(fin, np.abs(o - e), 0.0)
    bad = err > tol
    if bad.any():
        where = np.argwhere(bad)[:5]
        lines = [f"  at {tuple(w)}: out={o[tuple(w)]!r} ref={e[tuple(w)]!r} "
                 f"err={err[tuple(w)]:.3e} tol={tol[tuple(w)]:.3e}" for w in where]
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {o.size} elements outside the {dtype} tolerance "
            f"(max err/tol {np.max(err[bad] / tol[bad]):.2f}):\n" + "\n".join(lines))


def _grid(dtype):
    """Well separated values exactly representable in `dtype` (spacing >= 2^-8 in [-4, 4))."""
    if dtype == torch.bfloat16:
        return np.arange(-128, 128) * 2.0 ** -5     # 256 values, 8-bit significand
    return np.arange(-1024, 1024) * 2.0 ** -8      # 2048 values, fits fp16's 11 bits


def tie_free_logits(M, N, dtype, rng, lo=-4.0, hi=4.0):
    """[M, N] logits in `dtype` where each row holds N *different* values from a grid whose
    spacing (>= 2^-8 in x) keeps every normalised score (softmax, sigmoid, sqrt-softplus) apart
    by many fp32 ulps, in a random order (a random permutation per row). Exactly representable,
    so rounding to dtype creates no tie. bf16 supports N <= 256."""
    g = _grid(dtype)
    g = g[(g >= lo) & (g < hi)]
    if N > g.size:
        raise ValueError(f"tie-free {dtype} logits support N <= {g.size}, got {N}")
    if M == 0:
        return torch.zeros((0, N), dtype=dtype)
    pick = np.argsort(rng.random((M, g.size)), axis=1)[:, :N]
    t = torch.from_numpy(g[pick]).to(dtype)
    assert torch.equal(t.double(), torch.from_numpy(g[pick])), "grid not representable"
    return t


def tie_free_gating_inputs(M, N, dtype, rng, k, norm_type=1, with_bias=False, k_group=1,
                           group_count=1, group_select_mode=0, tries=200):
    """Tie-free logits (and a bias from a coarse grid, if asked) redrawn row by row until the
    reference's choice has no fp32 near-tie anywhere it matters (gating_ambiguous_rows)."""
    x = tie_free_logits(M, N, dtype, rng)
    bias = None
    if with_bias:
        bias = torch.from_numpy(rng.integers(-8, 9, N) * 0.0625).to(dtype)
    for _ in range(tries):
        amb = ref.gating_ambiguous_rows(x, k, bias, k_group, group_count, group_select_mode,
                                        norm_type)
        if not amb.any():
            return x, bias
        x[torch.from_numpy(amb)] = tie_free_logits(int(amb.sum()), N, dtype, rng)
    raise RuntimeError("could not draw tie-free gating inputs")


def randn(shape, dtype, rng, std=1.0, mean=0.0):
    """Random normal tensor, rounded to `dtype` (the reference must read the rounded tensor)."""
    a = rng.standard_normal(shape) * std + mean
    return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(dtype)


def uniform(shape, dtype, rng, lo, hi):
    a = rng.uniform(lo, hi, shape)
    return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(dtype)


def rand_perm_idx(n, rng, dtype=torch.int32):
    """A random permutation of [0, n): valid dropless expanded_row_idx (any layout)."""
    return torch.from_numpy(rng.permutation(n).astype(np.int64)).to(dtype)


def rand_droppad_idx(n_slots, E, C, rng, n_keep=None, dtype=torch.int32):
    """Drop-pad expanded_row_idx: a random subset of the n_slots (R*K) slots scattered into
    distinct positions of [0, E*C), every other slot -1. n_keep defaults to a random count."""
    cap = min(n_slots, E * C)
    if n_keep is None:
        n_keep = int(rng.integers(0, cap + 1))
    n_keep = min(n_keep, cap)
    idx = np.full(n_slots, -1, dtype=np.int64)
    slots = rng.choice(n_slots, n_keep, replace=False) if n_keep else np.zeros(0, np.int64)
    pos = rng.choice(E * C, n_keep, replace=False) if n_keep else np.zeros(0, np.int64)
    idx[slots] = pos
    return torch.from_numpy(idx).to(dtype)


def rand_expert_idx(R, K, E, rng, dtype=torch.int32, distinct=True):
    """[R, K] expert ids in [0, E): distinct per row (a routing result) unless distinct=False."""
    if R == 0:
        return torch.zeros((0, K), dtype=dtype)
    if distinct:
        a = np.argsort(rng.random((R, E)), axis=1)[:, :K]
    else:
        a = rng.integers(0, E, (R, K))
    return torch.from_numpy(a.astype(np.int64)).to(dtype)


@pytest.fixture
def three_threads():
    """Run the library with 3 CPU threads (uneven splits of rows/columns), restore afterwards."""
    import moegrad

    old = moegrad._C.get_num_threads()
    moegrad._C.set_num_threads(3)
    try:
        yield 3
    finally:
        moegrad._C.set_num_threads(old)
