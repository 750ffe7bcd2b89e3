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
import test_swiglu as tsw  # noqa: E402
from conftest import rand_expert_idx, randn, tie_free_gating_inputs  # noqa: E402

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
