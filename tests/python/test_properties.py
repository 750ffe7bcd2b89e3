"""Property tests (hypothesis) against the float64 reference (tests/python/reference.py) over the
whole attribute space of every operator, shapes included (0 rows, K = 1 and K = N, odd and
tiny H, every mode, every optional input present or absent, every dtype pair).

Hypothesis draws the configuration; the tensors come from a numpy generator whose seed is part
of the draw, so a failure prints everything needed to reproduce it (the falsifying example with
its seed, plus a note of the configuration). The comparison helpers are those of the per-op
suites. CI time is bounded by MOEGRAD_PROPERTY_EXAMPLES (default 25 per op; deadline off).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import moegrad  # noqa: E402
import test_finalize_routing as tfr  # noqa: E402
import test_gating_topk as tgt  # noqa: E402
import test_init_routing as tir  # noqa: E402
import test_swiglu as tsw  # noqa: E402
import test_swiglu_quant as tsq  # noqa: E402
import reference as ref  # noqa: E402
from _util_validation import assert_close_tol  # noqa: E402
from conftest import (assert_close_to_ref, rand_expert_idx, randn,  # noqa: E402
                      tie_free_gating_inputs)

EXAMPLES = int(os.environ.get("MOEGRAD_PROPERTY_EXAMPLES", "25"))
PROPS = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
SEEDS = st.integers(0, 2**32 - 1)
FACTORS = st.one_of(st.just(1.0), st.floats(-4.0, 4.0, allow_nan=False, width=32))
EPS = st.sampled_from([1e-20, 1e-10, 1e-6, 0.5])


@st.composite
def gating_config(draw):
    group_count = draw(st.sampled_from([1, 2, 4, 8]))
    group_size = draw(st.integers(1, 8))
    N = group_count * group_size
    k_group = draw(st.integers(1, group_count))
    mode = draw(st.sampled_from([0, 1] if group_size >= 2 else [0]))
    k = draw(st.integers(1, min(N, k_group * group_size)))
    return dict(M=draw(st.sampled_from([0, 1, 2, 5, 13])), N=N, k=k, k_group=k_group,
                group_count=group_count, group_select_mode=mode,
                renorm=draw(st.sampled_from([0, 1])), norm_type=draw(st.sampled_from([0, 1, 2])),
                out_flag=draw(st.booleans()), routed_scaling_factor=draw(FACTORS),
                eps=draw(EPS), bias=draw(st.booleans()), dtype=draw(DTYPES), seed=draw(SEEDS))


@PROPS
@given(gating_config())
def test_gating_top_k_forward_matches_reference(c):
    note(f"config: {c}")
    rng = np.random.default_rng(c["seed"])
    x, bias = tie_free_gating_inputs(c["M"], c["N"], c["dtype"], rng, c["k"], c["norm_type"],
                                     c["bias"], c["k_group"], c["group_count"],
                                     c["group_select_mode"])
    attrs = {a: c[a] for a in ("k_group", "group_count", "group_select_mode", "renorm",
                               "norm_type", "out_flag", "routed_scaling_factor", "eps")}
    out = tgt.run_forward("public", x, c["k"], bias, **attrs)
    tgt.check_forward(out, x, c["k"], bias, **attrs)


@st.composite
def gating_backward_config(draw):
    N = draw(st.sampled_from([2, 3, 8, 17, 64]))
    return dict(M=draw(st.sampled_from([0, 1, 3, 9])), N=N, K=draw(st.integers(1, N)),
                distinct=draw(st.booleans()), routed_scaling_factor=draw(FACTORS),
                eps=draw(EPS), saturate=draw(st.booleans()), dtype=draw(DTYPES),
                seed=draw(SEEDS))


@PROPS
@given(gating_backward_config())
def test_gating_top_k_backward_matches_reference(c):
    note(f"config: {c}")
    rng = np.random.default_rng(c["seed"])
    xn = tgt.make_x_norm(c["M"], c["N"], rng, saturate=c["saturate"])
    gy = randn((c["M"], c["K"]), c["dtype"], rng)
    e = rand_expert_idx(c["M"], c["K"], c["N"], rng, distinct=c["distinct"])
    rsf, eps = c["routed_scaling_factor"], c["eps"]
    gx = tgt.run_backward("public", xn, gy, e, routed_scaling_factor=rsf, eps=eps)
    tgt.check_backward(gx, xn, gy, e, rsf, eps)


@st.composite
def finalize_config(draw):
    mode = draw(st.sampled_from([0, 1, 2, 3]))
    scales = draw(st.booleans())
    K = draw(st.integers(1, 4)) if scales or draw(st.booleans()) else 1
    x1 = draw(st.booleans())
    return dict(drop_pad_mode=mode, R=draw(st.sampled_from([0, 1, 2, 7])), K=K,
                H=draw(st.sampled_from([1, 2, 7, 16, 33])), E=draw(st.integers(1, 5)),
                C=draw(st.integers(1, 5)), scales=scales, bias=draw(st.booleans()), x1=x1,
                x2=x1 and draw(st.booleans()), scales_dtype=draw(st.sampled_from(["same", "fp32"])),
                dtype=draw(DTYPES), seed=draw(SEEDS))


@PROPS
@given(finalize_config())
def test_finalize_routing_forward_matches_reference(c):
    note(f"config: {c}")
    rng = np.random.default_rng(c["seed"])
    case = tfr.make_forward_case(rng, c["dtype"], c["drop_pad_mode"], c["R"], c["K"], c["H"],
                                 c["E"], C=c["C"], scales=c["scales"], bias=c["bias"],
                                 x1=c["x1"], x2=c["x2"])
    if c["scales"] and c["scales_dtype"] == "fp32":
        case["scales"] = case["scales"].float()
    # Without scales, expert_idx and x1 the token count comes from k = K (L4, L51).
    tfr.check_forward(tfr.run_forward("public", **case), **case)


@st.composite
def finalize_grad_config(draw):
    mode = draw(st.sampled_from([0, 1]))
    R, K = draw(st.sampled_from([0, 1, 3, 8])), draw(st.integers(1, 4))
    n = R * K
    active = draw(st.sampled_from([0, 1, max(n - 1, 0), n, n + 3])) if mode == 0 else 0
    return dict(drop_pad_mode=mode, R=R, K=K, H=draw(st.sampled_from([1, 3, 16, 33])),
                E=draw(st.integers(1, 5)), C=draw(st.integers(1, 5)), scales=draw(st.booleans()),
                bias=draw(st.booleans()), active_num=active,
                scales_dtype=draw(st.sampled_from(["same", "fp32"])), dtype=draw(DTYPES),
                seed=draw(SEEDS))


@PROPS
@given(finalize_grad_config())
def test_finalize_routing_grad_matches_reference(c):
    note(f"config: {c}")
    rng = np.random.default_rng(c["seed"])
    K = c["K"] if c["scales"] else 1
    case = tfr.make_grad_case(rng, c["dtype"], c["drop_pad_mode"], c["R"], K, c["H"], c["E"],
                              C=c["C"], scales=c["scales"], bias=c["bias"],
                              active_num=c["active_num"])
    if c["scales"] and c["scales_dtype"] == "fp32":
        case["scales"] = case["scales"].float()
    tfr.check_grad(tfr.run_grad("public", **case), **case)


@st.composite
def swiglu_config(draw):
    lead = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=0, max_size=3)))
    if not lead:
        lead = (draw(st.sampled_from([1, 4])),)
    T = int(np.prod(lead))
    wshape = draw(st.sampled_from(["none", "T", "lead", "T1"]))
    gi = draw(st.one_of(
        st.none(),
        st.lists(st.integers(0, 4), min_size=0, max_size=4),
        st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=4)))
    return dict(lead=lead, T=T, H=draw(st.sampled_from([1, 2, 7, 16, 33])), wshape=wshape,
                group_index=gi,
                clamp_limit=draw(st.one_of(st.just(-1.0), st.floats(0.0625, 10.0, width=32))),
                std=draw(st.sampled_from([0.5, 2.0, 8.0])), dtype=draw(DTYPES), seed=draw(SEEDS))


def _swiglu_inputs(c):
    rng = np.random.default_rng(c["seed"])
    lead, T, H, dt = c["lead"], c["T"], c["H"], c["dtype"]
    x = randn(lead + (2 * H,), dt, rng, std=c["std"])
    wsh = {"none": None, "T": (T,), "lead": lead, "T1": (T, 1)}[c["wshape"]]
    weight = None if wsh is None else randn(wsh, torch.float32, rng)
    gy = randn(lead + (H,), dt, rng)
    yo = randn(lead + (H,), dt, rng) if weight is not None else None
    gi = None if c["group_index"] is None else torch.tensor(c["group_index"], dtype=torch.int64)
    return x, weight, gy, yo, gi


@PROPS
@given(swiglu_config())
def test_swiglu_forward_matches_reference(c):
    note(f"config: {c}")
    x, weight, _, _, gi = _swiglu_inputs(c)
    y = tsw.run_forward("public", x, weight, gi, c["clamp_limit"])
    tsw.check_forward(y, x, weight, gi, c["clamp_limit"])


@PROPS
@given(swiglu_config())
def test_swiglu_backward_matches_reference(c):
    note(f"config: {c}")
    x, weight, gy, yo, gi = _swiglu_inputs(c)
    out = tsw.run_backward("public", gy, x, weight, yo, gi, c["clamp_limit"])
    tsw.check_backward(out, gy, x, weight, yo, gi, c["clamp_limit"])
    if weight is None:
        assert out[1].dtype == torch.float32 and tuple(out[1].shape) == (0,)


@PROPS
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 8), SEEDS)
def test_finalize_k_agrees_with_the_tensors(R, K, H, seed):
    """L51: any k >= 1 either equals the tensors' K or is refused naming k; k = 1 is the default."""
    rng = np.random.default_rng(seed)
    case = tfr.make_forward_case(rng, torch.float32, 0, R, K, H, 3)
    case.pop("R"), case.pop("K")
    base = moegrad.moe_finalize_routing(**case)
    for k in (1, K, K + 1, 2 * K + 1):
        if k in (1, K):
            assert torch.equal(moegrad.moe_finalize_routing(**case, k=k), base)
        else:
            with pytest.raises(moegrad.MoeError) as info:
                moegrad.moe_finalize_routing(**case, k=k)
            assert info.value.code == 561103 and ": k: " in str(info.value)


# --------------------------------------------------------------- token permutation (§8) --
# moe_init_routing covers the V2 and V3 attribute space through one function: dropless,
# active truncation (A > 0, A >= R*K, A = -1), drop/pad with a capacity below and above the
# load, the active expert window, the three count encodings with the flag on and off, both
# index directions, int32 and int64 ids, E unknown (0) with sparse ids.

@st.composite
def init_routing_config(draw):
    mode = draw(st.sampled_from([0, 1]))
    R, K = draw(st.sampled_from([0, 1, 2, 5, 13])), draw(st.integers(1, 4))
    E = draw(st.integers(1, 9)) if mode == 1 else draw(st.sampled_from([0, 1, 2, 3, 8, 17]))
    flag = E > 0 and draw(st.booleans())
    rng_ = None
    if E > 0 and draw(st.booleans()):
        if mode == 1:  # drop/pad takes only the full window
            rng_ = [0, E]
        else:
            lo = draw(st.integers(0, E - 1))
            rng_ = [lo, draw(st.integers(lo + 1, E))]
    N = R * K
    active = draw(st.sampled_from([0, -1, 1, max(N - 1, 0), N, N + 3])) if mode == 0 else 0
    return dict(R=R, K=K, E=E, H=draw(st.sampled_from([1, 2, 7, 16, 33])), drop_pad_mode=mode,
                expert_capacity=draw(st.integers(1, 6)) if mode == 1 else 0, active_num=active,
                expert_tokens_num_type=draw(st.sampled_from([0, 1, 2])),
                expert_tokens_num_flag=flag, active_expert_range=rng_,
                row_idx_type=draw(st.sampled_from([0, 1])) if mode == 0 else 0,
                distinct=draw(st.booleans()), sparse=draw(st.booleans()),
                idx_dtype=draw(st.sampled_from([torch.int32, torch.int64])), dtype=draw(DTYPES),
                seed=draw(SEEDS))


_INIT_ATTRS = ("active_num", "expert_capacity", "expert_num", "drop_pad_mode",
               "expert_tokens_num_type", "expert_tokens_num_flag", "active_expert_range",
               "row_idx_type")


def _init_routing_inputs(c):
    rng = np.random.default_rng(c["seed"])
    R, K, E = c["R"], c["K"], c["E"]
    x = randn((R, c["H"]), c["dtype"], rng)
    if E > 0:
        eidx = rand_expert_idx(R, K, E, rng, dtype=c["idx_dtype"],
                               distinct=c["distinct"] and K <= E)
    else:  # E unknown: any ids >= 0, dense or far apart
        hi = 2**30 if c["sparse"] else 12
        eidx = torch.from_numpy(rng.integers(0, hi, (R, K))).to(c["idx_dtype"])
    attrs = {a: c.get(a, c["E"] if a == "expert_num" else None) for a in _INIT_ATTRS}
    return rng, x, eidx, attrs


@PROPS
@given(init_routing_config())
def test_init_routing_matches_reference(c):
    note(f"config: {c}")
    _, x, eidx, attrs = _init_routing_inputs(c)
    ex, idx, tok = tir._run_checked(x, eidx, attrs)
    if not c["expert_tokens_num_flag"]:
        assert tuple(tok.shape) == (0,)


@PROPS
@given(init_routing_config(), st.booleans())
def test_init_routing_grad_matches_reference(c, from_forward):
    """The grad against the float64 sum, on the forward's index (every mode, window and
    truncation) or on a random injective index of the same layout with -1 holes."""
    note(f"config: {c}, index from the forward: {from_forward}")
    c = dict(c, row_idx_type=0)  # the grad takes the src->dst index only
    rng, x, eidx, attrs = _init_routing_inputs(c)
    ex, idx, _ = moegrad.moe_init_routing(x, eidx, **attrs)
    N = c["R"] * c["K"]
    mode, active = c["drop_pad_mode"], max(c["active_num"], 0)
    if not from_forward:
        rows = int(np.prod(tuple(ex.shape[:-1])))
        perm = rng.permutation(max(rows, N))[:N]
        vals = np.where(perm < rows, perm, -1)
        vals[rng.random(N) < 0.2] = -1
        idx = torch.from_numpy(vals.astype(np.int64)).to(torch.int32)
    g = randn(tuple(ex.shape), c["dtype"], rng)
    out = moegrad.moe_init_routing_grad(g, idx, c["K"], mode, active)
    want = ref.moe_init_routing_grad(g, idx, c["K"], mode, active)
    scale = ref.moe_init_routing_grad(g.abs(), idx, c["K"], mode, active)
    assert out.dtype == c["dtype"] and tuple(out.shape) == (c["R"], c["H"])
    assert_close_to_ref(out, want, scale=scale, n_reduce=c["K"], what="grad_x")


# ------------------------------------------------------------ SwiGLU quant forward (§6) --

@st.composite
def swiglu_quant_config(draw):
    lead = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=1, max_size=4)))
    T = int(np.prod(lead))
    mode = draw(st.sampled_from([0, 1]))
    gi = draw(st.one_of(
        st.none(),
        st.lists(st.integers(0, 6), min_size=0, max_size=4),
        st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=4)))
    return dict(lead=lead, T=T, H=draw(st.sampled_from([1, 2, 31, 32, 33, 96, 128, 129, 300])),
                dst=draw(st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2])),
                quant_mode=mode, round_scale=True if mode == 1 else draw(st.booleans()),
                wshape=draw(st.sampled_from(["none", "T", "lead", "T1"])), group_index=gi,
                clamp_limit=draw(st.one_of(st.just(-1.0), st.floats(0.0625, 10.0, width=32))),
                std=draw(st.sampled_from([1e-3, 0.5, 2.5, 8.0])),
                output_origin=draw(st.booleans()), dtype=draw(DTYPES), seed=draw(SEEDS))


@PROPS
@given(swiglu_quant_config())
def test_swiglu_quant_matches_reference(c):
    note(f"config: {c}")
    rng = np.random.default_rng(c["seed"])
    lead, T, H = c["lead"], c["T"], c["H"]
    x = randn(lead + (2 * H,), c["dtype"], rng, std=c["std"])
    wsh = {"none": None, "T": (T,), "lead": lead, "T1": (T, 1)}[c["wshape"]]
    w = None if wsh is None else torch.from_numpy(0.2 + rng.random(wsh)).float()
    gi = None if c["group_index"] is None else torch.tensor(c["group_index"], dtype=torch.int64)
    y, s, o = moegrad.swiglu_group_quant(x, w, gi, dst_type=c["dst"],
                                         quant_mode=c["quant_mode"],
                                         round_scale=c["round_scale"],
                                         clamp_limit=c["clamp_limit"],
                                         output_origin=c["output_origin"])
    B = 128 if c["quant_mode"] == 0 else 32
    nb = (H + B - 1) // B
    assert y.dtype == c["dst"] and tuple(y.shape) == lead + (H,)
    if c["quant_mode"] == 0:
        assert s.dtype == torch.float32 and tuple(s.shape) == lead + (nb,)
    else:
        assert s.dtype == torch.float8_e8m0fnu and tuple(s.shape) == lead + ((nb + 1) // 2, 2)
        if nb % 2:  # the pad entry of an odd block count is code 0
            assert bool((s.view(torch.uint8)[..., -1, 1] == 0).all())
    tsq.check_values(x, y, s, c["dst"], c["quant_mode"], c["round_scale"], w, gi,
                     c["clamp_limit"])
    if c["output_origin"]:
        assert o.dtype == c["dtype"] and tuple(o.shape) == lead + (H,)
        assert_close_tol(o, tsq.swiglu64(x, w, gi, c["clamp_limit"]), c["dtype"],
                         what="y_origin")
    else:
        assert tuple(o.shape) == (0,)
