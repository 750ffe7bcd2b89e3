"""Second-order gradients through every operator family (docs/decisions.md L150-L152).

Each registered operator either has a gradient formula or refuses: a gradient reaching a
backward op without one raises MoeError 561003 "<op>: double backward is not supported; ...",
never None. For each forward op a first-order gradient is taken with create_graph=True and then
a gradient of it (a random weighting of every first-order gradient, never ones): it either
matches float64 torch.autograd of the forward formula or raises that error. The refusal fires
only when a second-order gradient flows: not at first order, not under no_grad.
"""

from __future__ import annotations

import pytest
import torch

import moegrad
from _util_validation import assert_close_tol, gen, rand, randn, randperm, upstream  # noqa: F401
from moegrad.ops._registry import OPS, _op
from test_autograd import FIN_CFGS, _fin_inputs, finalize_ref

F32, F64, I32 = torch.float32, torch.float64, torch.int32
ERR_NO_KERNEL = 561003

# What each backward op does under double backward (docs/architecture.md, L151/L152).
REFUSED = {"moe_gating_top_k_backward", "swiglu_group_quant_backward"}


def _d64(t):
    return None if t is None else t.detach().double().requires_grad_(t.requires_grad)


def _second_order(outs, inputs, upstreams, seeds, wrt):
    """grad of sum_i <g_i, seeds[i]> w.r.t. `wrt`, g = the first-order grads of outs."""
    first = torch.autograd.grad(outs, inputs, upstreams, create_graph=True, allow_unused=True)
    total = sum((g * s).sum() for g, s in zip(first, seeds) if g is not None)
    return first, torch.autograd.grad(total, wrt, allow_unused=True)


def _check(got, want, names, n_reduce):
    for g, w, name in zip(got, want, names):
        if w is None:
            assert g is None or not g.any(), name
            continue
        assert g is not None, f"{name}: second-order gradient dropped"
        assert g.shape == w.shape and g.dtype == F32, name
        assert_close_tol(g, w, F32, what=name, n_reduce=n_reduce)


def _assert_refused(exc_info, op):
    assert exc_info.value.code == ERR_NO_KERNEL
    assert str(exc_info.value).startswith(f"{op}: double backward is not supported; "), \
        str(exc_info.value)


# ------------------------------------------------------------------------------ registry ----

def test_every_registered_op_has_a_formula_or_refuses():
    """A new operator cannot forget: each one called register_autograd or declared
    _op(..., no_double_backward=<why>)."""
    assert len(OPS) >= 12
    undeclared = [n for n, op in OPS.items() if op._grad_kind not in ("formula", "refused")]
    assert not undeclared, f"ops with neither a gradient formula nor a refusal: {undeclared}"
    for name in REFUSED:
        assert OPS[name]._grad_kind == "refused", name
        assert OPS[name]._no_grad_reason, name


def test_undeclared_op_raises_instead_of_returning_none():
    name = "test_double_backward_undeclared"
    try:
        @_op(f"moegrad::{name}")
        def undeclared(x: torch.Tensor) -> torch.Tensor:
            return x * 2.0

        x = torch.randn(3, requires_grad=True)
        y = undeclared(x)
        assert y.requires_grad
        with pytest.raises(moegrad.MoeError) as ei:
            y.sum().backward()
        assert ei.value.code == ERR_NO_KERNEL and str(ei.value).startswith(name + ": backward")
    finally:
        OPS.pop(name, None)


def test_refusal_only_when_a_second_order_gradient_flows(gen):
    x = randn(gen, 5, 16).requires_grad_()
    y, idx, _ = moegrad.moe_gating_top_k(x, 3, norm_type=1)
    gy = upstream(gen, 5, 3)
    (g_plain,) = torch.autograd.grad(y, x, gy, retain_graph=True)
    (g_graph,) = torch.autograd.grad(y, x, gy, create_graph=True)  # first order: no error
    assert torch.equal(g_plain, g_graph.detach()) and g_graph.requires_grad
    s = torch.sigmoid(x.detach()).requires_grad_()
    with torch.no_grad():  # no graph, no error
        gx = moegrad.moe_gating_top_k_backward(s, gy, idx, 0, 1)
    assert not gx.requires_grad
    gx = moegrad.moe_gating_top_k_backward(s, gy, idx, 0, 1)  # records, does not raise yet
    assert torch.equal(gx.detach(), g_plain)
    with pytest.raises(moegrad.MoeError) as ei:
        gx.mul(upstream(gen, 5, 16)).sum().backward()
    _assert_refused(ei, "moe_gating_top_k_backward")


# -------------------------------------------------------------------------------- gating ----

@pytest.mark.parametrize("norm_type,renorm,out_flag", [(0, 0, False), (0, 1, True),
                                                       (1, 0, False), (2, 0, True)])
def test_gating_double_backward_refused(gen, norm_type, renorm, out_flag):
    x = randn(gen, 6, 16).requires_grad_()
    y, _idx, norm = moegrad.moe_gating_top_k(x, 4, renorm=renorm, norm_type=norm_type,
                                             out_flag=out_flag)
    outs, ups = [y], [upstream(gen, 6, 4).requires_grad_()]
    if out_flag:
        outs.append(norm)
        ups.append(upstream(gen, 6, 16))
    (gx,) = torch.autograd.grad(outs, x, ups, create_graph=True)
    with pytest.raises(moegrad.MoeError) as ei:
        torch.autograd.grad((gx * upstream(gen, 6, 16)).sum(), [x, ups[0]])
    _assert_refused(ei, "moe_gating_top_k_backward")


# -------------------------------------------------------------------------------- swiglu ----

@pytest.mark.parametrize("quant", [False, True], ids=["swiglu_group", "swiglu_group_quant"])
def test_swiglu_double_backward_refused(gen, quant):
    x = randn(gen, 6, 64).requires_grad_()
    w = rand(gen, 6, lo=0.5, hi=1.5).requires_grad_()
    if quant:
        y = moegrad.swiglu_group_quant(x, w, output_origin=True)[2]
    else:
        y = moegrad.swiglu_group(x, w, clamp_limit=2.0)
    gy = upstream(gen, 6, 32).requires_grad_()
    gx, gw = torch.autograd.grad(y, [x, w], gy, create_graph=True)
    with pytest.raises(moegrad.MoeError) as ei:
        torch.autograd.grad((gx * upstream(gen, 6, 64)).sum() + (gw * 0.5).sum(), [x, w, gy])
    _assert_refused(ei, "swiglu_group_quant_backward")


# ------------------------------------------------------------------------------ finalize ----

@pytest.mark.parametrize("cfg", FIN_CFGS)  # every mode and optional-input case
def test_finalize_double_backward(gen, cfg):
    """Through moe_finalize_routing_grad and moe_finalize_routing_bias_grad: second-order
    gradients w.r.t. expanded_x, scales, bias and the upstream gradient."""
    R, H, E, C, K, mode = 6, 24, 4, 8, cfg["K"], cfg["mode"]
    ex, idx = _fin_inputs(gen, R, K, H, E, C, mode, F32, cfg.get("trunc"))
    ex.requires_grad_()
    scales = rand(gen, R, K, lo=0.1, hi=1.0).requires_grad_() if cfg["scales"] else None
    bias = randn(gen, E, H).requires_grad_() if cfg["bias"] else None
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32) if cfg["bias"] else None
    x1 = randn(gen, R, H).requires_grad_() if cfg["x1"] else None
    x2 = randn(gen, R, H).requires_grad_() if cfg["x2"] else None
    gy = upstream(gen, R, H).requires_grad_()
    leaves = [t for t in (ex, scales, bias, x1, x2) if t is not None]
    seeds = [upstream(gen, *t.shape) for t in leaves]
    names = ["d_" + n for n, t in zip(("expanded_x", "scales", "bias", "x1", "x2"),
                                      (ex, scales, bias, x1, x2)) if t is not None] + ["d_gy"]

    out = moegrad.moe_finalize_routing(ex, idx, x1=x1, x2=x2, bias=bias, scales=scales,
                                       expert_idx=eid, drop_pad_mode=mode, k=K)
    _, got = _second_order(out, leaves, gy, seeds, leaves + [gy])

    l64 = [_d64(t) for t in leaves]
    it = iter(l64)
    ex64, sc64, b64, x164, x264 = (next(it) if t is not None else None
                                   for t in (ex, scales, bias, x1, x2))
    gy64 = _d64(gy)
    ref = finalize_ref(ex64, idx, x164, x264, b64, sc64, eid, mode, R, K)
    _, want = _second_order(ref, l64, gy64, [s.double() for s in seeds], l64 + [gy64])
    _check(got, want, names, n_reduce=H + K)


@pytest.mark.parametrize("with_scales", [True, False])
def test_finalize_bias_grad_double_backward(gen, with_scales):
    """The internal bias-gradient op on its own: d/d grad_y and d/d scales."""
    R, K, H, E = 7, 3, 16, 5
    gy = upstream(gen, R, H).requires_grad_()
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32)
    scales = rand(gen, R, K, lo=0.1, hi=1.0).requires_grad_() if with_scales else None
    gb = moegrad.ops.finalize_routing.moe_finalize_routing_bias_grad(gy, eid, scales, E)
    v = upstream(gen, E, H)
    wrt = [gy] + ([scales] if with_scales else [])
    got = torch.autograd.grad((gb * v).sum(), wrt)
    g64 = gy.detach().double().requires_grad_()
    s64 = scales.detach().double().requires_grad_() if with_scales else None
    w = s64 if with_scales else torch.ones(R, K, dtype=F64)
    ref = torch.zeros(E, H, dtype=F64).index_add(0, eid.reshape(-1).long(),
                                                 (w.unsqueeze(2) * g64.unsqueeze(1)).reshape(-1, H))
    want = torch.autograd.grad((ref * v.double()).sum(), [g64] + ([s64] if with_scales else []))
    _check(got, want, ["d_grad_y", "d_scales"], n_reduce=H)


# -------------------------------------------------------------------------- init routing ----

@pytest.mark.parametrize("kw", [
    pytest.param(dict(), id="dropless"),
    pytest.param(dict(active_num=9), id="active_num"),
    pytest.param(dict(expert_num=4, active_expert_range=[1, 3]), id="window"),
    pytest.param(dict(drop_pad_mode=1, expert_num=4, expert_capacity=2), id="drop-pad"),
])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["fp32", "bf16"])
def test_init_routing_double_backward(gen, kw, dtype):
    """moe_init_routing_grad is linear: the second-order gradient w.r.t. the upstream gradient
    is the scatter of the seed (float64 autograd of the copy formula, exact in every dtype);
    w.r.t. x it is zero."""
    R, K, H, E = 6, 3, 8, 4
    x = randn(gen, R, H, dtype=dtype).requires_grad_()
    eid = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(R)]).to(I32)
    ex, idx, _ = moegrad.moe_init_routing(x, eid, **kw)
    up = upstream(gen, *ex.shape, dtype=dtype).requires_grad_()
    seed = upstream(gen, R, H, dtype=dtype)
    _, got = _second_order(ex, [x], up, [seed], [up, x])

    x64, up64 = x.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    rows = ex.numel() // H
    d = idx.long()
    valid = (d >= 0) & (d < rows)
    slots = valid.nonzero().squeeze(1)
    ref = torch.zeros(rows, H, dtype=F64).index_add(0, d[slots], x64[slots // K])
    _, want = _second_order(ref.reshape(ex.shape), [x64], up64, [seed.double()], [up64, x64])
    assert want[1] is None and (got[1] is None or not got[1].any())
    assert got[0].dtype == dtype and torch.equal(got[0].double(), want[0])  # copies: exact


# --------------------------------------------------------------------------- grouped_mm ----

@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_grouped_mm_double_backward(gen, with_bias):
    """moegrad.nn's grouped product: its backward is bilinear (the bias gradient linear), its
    second order matches float64 autograd of x_e @ w_e (+ b_e) (rows past sum(counts) zero)."""
    from moegrad.nn.moe import _grouped_mm_op
    E, A, B = 3, 5, 4
    counts = torch.tensor([2, 0, 3])
    rows = 6  # one row past sum(counts)
    x = randn(gen, rows, A).requires_grad_()
    w = randn(gen, E, A, B).requires_grad_()
    b = randn(gen, E, B).requires_grad_() if with_bias else None
    gy = upstream(gen, rows, B).requires_grad_()
    params = [x, w] + ([b] if with_bias else [])
    seeds = [upstream(gen, rows, A), upstream(gen, E, A, B)] + (
        [upstream(gen, E, B)] if with_bias else [])
    out = _grouped_mm_op(x, w, counts, b)
    _, got = _second_order(out, params, gy, seeds, params + [gy])

    x64, w64, gy64 = _d64(x), _d64(w), _d64(gy)
    b64 = _d64(b) if with_bias else None
    parts, start = [], 0
    for e, c in enumerate(counts.tolist()):
        parts.append(x64[start:start + c] @ w64[e] + (b64[e] if with_bias else 0.0))
        start += c
    parts.append(torch.zeros(rows - start, B, dtype=F64))
    params64 = [x64, w64] + ([b64] if with_bias else [])
    _, want = _second_order(torch.cat(parts), params64, gy64, [s.double() for s in seeds],
                            params64 + [gy64])
    names = ["d_x", "d_w"] + (["d_b"] if with_bias else []) + ["d_gy"]
    _check(got, want, names, n_reduce=A + B + rows)


# ------------------------------------------------------------------- permute / unpermute ----

@pytest.mark.parametrize("capacity", [0, 2], ids=["dropless", "capacity"])
def test_permute_pair_double_backward(gen, capacity):
    """moe_permute -> tanh -> moe_unpermute: second-order gradients through
    moe_init_routing_grad and moe_finalize_routing_grad together, against float64 autograd of
    y[r] = sum_k kept[r,k] * scales[r,k] * tanh(x[r])."""
    R, K, H, E = 6, 2, 8, 4
    x = randn(gen, R, H).requires_grad_()
    scales = rand(gen, R, K, lo=0.1, hi=1.0).requires_grad_()
    eid = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(R)]).to(I32)
    ex, state = moegrad.moe_permute(x, eid, E, capacity=capacity)
    y = moegrad.moe_unpermute(torch.tanh(ex), state, scales)
    gy = upstream(gen, R, H).requires_grad_()
    seeds = [upstream(gen, R, H), upstream(gen, R, K)]
    _, got = _second_order(y, [x, scales], gy, seeds, [x, scales, gy])

    kept = (state.expanded_row_idx.reshape(R, K) >= 0).double()
    x64, s64, gy64 = _d64(x), _d64(scales), _d64(gy)
    ref = (kept * s64).sum(1, keepdim=True) * torch.tanh(x64)
    _, want = _second_order(ref, [x64, s64], gy64, [s.double() for s in seeds],
                            [x64, s64, gy64])
    _check(got, want, ["d_x", "d_scales", "d_gy"], n_reduce=H + K)
