"""Autograd of the three forwards against torch.autograd of the same formula in float64.

The library computes in fp32 (D12), so each gradient is compared with the float64 autograd of the
formula written in plain PyTorch, with the per-dtype tolerance of the shared table. Upstream
gradients are random (never ones). Covers: gating for every norm type (sigmoid, softmax with renorm 0/1, sqrt-softplus; bias,
groups, renorm, routed_scaling_factor, eps, norm_out gradient; D22, L10), finalize routing per operators.md
§7.3 and D23 (modes 0-3, with/without scales, synthesized ones-scales, bias/expert_idx, true
x1/x2/bias gradients without warning; D7, D8, L5), SwiGLU (x and weight
gradients, clamp with strict masks, group_index truncation; D9, D10, D11, L8).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import moegrad
import reference as refm  # noqa: E402  (conftest puts tests/python on sys.path)
from _util_validation import assert_close_tol, gen, rand, randn, randperm, upstream  # noqa: F401

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
I32, I64 = torch.int32, torch.int64


# ================================================================================= gating ====

def f32(v):
    """Attributes reach the kernels as fp32 (§1.4, §2.2, §5.6)."""
    return float(torch.tensor(v, dtype=F32))


def gating_ref(x, idx, rsf, eps):
    """Forward sigmoid path (§1.5/§2.4) in float64 for a fixed selection `idx`."""
    rsf, eps = f32(rsf), f32(eps)
    s = torch.sigmoid(x)
    g = s.gather(1, idx.long())
    y = g / (g.sum(-1, keepdim=True) + eps) * rsf
    return y, s


def gating_mag(s64, gy, idx, rsf, eps, gn=None):
    """Magnitude of the terms of the gating gradient (conftest.TOLERANCES `scale`): §1.5 with
    every term replaced by its absolute value. The factor s·(1 − s) is formed from the fp32
    forward output s, and 1 − s is a cancelling difference (terms 1 and s), so its magnitude is
    s·(1 + s): an ulp of s near 1 is a large relative error of 1 − s."""
    s = s64.detach()
    gs = (f32(rsf) * gy.detach().double()).abs()
    e = idx.long()
    wp = s.gather(1, e)
    D = (f32(eps) + wp.sum(1, keepdim=True)).abs()
    beta = (wp.abs() / D * gs).sum(1, keepdim=True)
    G = torch.zeros_like(s).scatter_add_(1, e, (gs + beta) / D)
    m = s * (1 + s) * G
    if gn is not None:
        m = m + gn.double().abs() * s * (1 + s)
    return m


GATING_CFGS = [
    pytest.param(dict(M=16, N=32, k=4, bias=True, k_group=2, group_count=4, gsm=0, renorm=0,
                      rsf=2.5, eps=1e-20, out_flag=False), id="groups-max-rsf2.5"),
    pytest.param(dict(M=12, N=32, k=5, bias=True, k_group=3, group_count=8, gsm=1, renorm=1,
                      rsf=-1.5, eps=0.3, out_flag=True), id="groups-top2-renorm-negrsf-eps0.3"),
    pytest.param(dict(M=8, N=8, k=8, bias=False, k_group=1, group_count=1, gsm=0, renorm=0,
                      rsf=1.0, eps=1e-20, out_flag=True), id="K-eq-N"),
    pytest.param(dict(M=9, N=2, k=1, bias=True, k_group=1, group_count=1, gsm=0, renorm=0,
                      rsf=1.0, eps=1e-10, out_flag=False), id="N2-K1"),
    pytest.param(dict(M=6, N=257, k=7, bias=True, k_group=1, group_count=1, gsm=0, renorm=0,
                      rsf=0.1, eps=1e-6, out_flag=True), id="N257-odd"),
]


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cfg", GATING_CFGS)
def test_gating_sigmoid_autograd(gen, cfg, dtype):
    M, N, k = cfg["M"], cfg["N"], cfg["k"]
    x = randn(gen, M, N, dtype=dtype, scale=2.0).requires_grad_()
    bias = randn(gen, N, dtype=dtype, scale=0.2) if cfg["bias"] else None
    y, idx, norm_out = moegrad.moe_gating_top_k(
        x, k, bias=bias, k_group=cfg["k_group"], group_count=cfg["group_count"],
        group_select_mode=cfg["gsm"], renorm=cfg["renorm"], norm_type=1,
        out_flag=cfg["out_flag"], routed_scaling_factor=cfg["rsf"], eps=cfg["eps"])
    assert y.dtype == dtype and idx.dtype == I32 and norm_out.dtype == F32
    # The selection is the library's (checked elsewhere against a reference); here it must at
    # least be a valid one: in range, unique per row.
    assert int(idx.min()) >= 0 and int(idx.max()) < N
    assert all(len(set(r.tolist())) == k for r in idx)

    gy = upstream(gen, M, k, dtype=dtype)
    gn = upstream(gen, M, N) if cfg["out_flag"] else None
    loss = (y * gy).sum(dtype=F32) if dtype != F32 else (y * gy).sum()
    if gn is not None:
        loss = loss + (norm_out * gn).sum()
    loss.backward()

    x64 = x.detach().double().requires_grad_()
    y64, s64 = gating_ref(x64, idx, cfg["rsf"], cfg["eps"])
    loss64 = (y64 * gy.double()).sum()
    if gn is not None:
        loss64 = loss64 + (s64 * gn.double()).sum()
    loss64.backward()

    assert_close_tol(y, y64.detach(), dtype, what="y", n_reduce=k,
                     scale=y64.detach().abs())
    if cfg["out_flag"]:
        assert_close_tol(norm_out, s64.detach(), F32, what="norm_out", scale=s64.detach())
    assert x.grad.dtype == dtype and x.grad.shape == (M, N)
    assert_close_tol(x.grad, x64.grad, dtype, what="grad_x", n_reduce=k,
                     scale=gating_mag(s64, gy.double(), idx, cfg["rsf"], cfg["eps"], gn))


@pytest.mark.parametrize("through", ["y-only", "norm_out-only"])
def test_gating_autograd_single_output(gen, through):
    """Gradient reaching only y or only norm_out (the other grad is None), L10."""
    M, N, k = 10, 24, 3
    x = randn(gen, M, N, scale=2.0).requires_grad_()
    y, idx, norm_out = moegrad.moe_gating_top_k(x, k, norm_type=1, out_flag=True,
                                                routed_scaling_factor=1.7, eps=1e-8)
    g = upstream(gen, M, k) if through == "y-only" else upstream(gen, M, N)
    out = y if through == "y-only" else norm_out
    (out * g).sum().backward()
    x64 = x.detach().double().requires_grad_()
    y64, s64 = gating_ref(x64, idx, 1.7, 1e-8)
    ((y64 if through == "y-only" else s64) * g.double()).sum().backward()
    mag = (gating_mag(s64, g.double(), idx, 1.7, 1e-8) if through == "y-only"
           else gating_mag(s64, torch.zeros(M, k, dtype=F64), idx, 1.7, 1e-8, g))
    assert_close_tol(x.grad, x64.grad, F32, what="grad_x", n_reduce=k, scale=mag)


def test_gating_no_bias_gradient(gen):
    """L10: bias is used for selection only and gets no gradient."""
    M, N, k = 8, 16, 4
    x = randn(gen, M, N).requires_grad_()
    bias = randn(gen, N, scale=0.3).requires_grad_()
    y, idx, _ = moegrad.moe_gating_top_k(x, k, bias=bias, k_group=2, group_count=4, norm_type=1)
    gy = upstream(gen, M, k)
    (y * gy).sum().backward()
    assert bias.grad is None or torch.count_nonzero(bias.grad) == 0
    x64 = x.detach().double().requires_grad_()
    y64, s64 = gating_ref(x64, idx, 1.0, 1e-20)
    (y64 * gy.double()).sum().backward()
    assert_close_tol(x.grad, x64.grad, F32, what="grad_x", n_reduce=k,
                     scale=gating_mag(s64, gy.double(), idx, 1.0, 1e-20))


def normalise64(x, norm_type):
    if norm_type == 0:
        return torch.softmax(x, dim=-1)
    if norm_type == 1:
        return torch.sigmoid(x)
    return torch.sqrt(F.softplus(x))


def gating_ref_any(x, idx, rsf, eps, norm_type, renorm):
    """Forward of §2.4 steps 5-7 for a fixed selection, any norm type, float64."""
    rsf, eps = f32(rsf), f32(eps)
    s = normalise64(x, norm_type)
    g = s.gather(1, idx.long())
    if norm_type in (1, 2) or renorm == 1:
        g = g / (g.sum(-1, keepdim=True) + eps)
    return g * rsf, s


def gating_mag_any(s64, gy, idx, rsf, eps, norm_type, renorm, gn=None):
    """Magnitude of the terms of the D22 gradient (every term by its absolute value)."""
    if norm_type == 1:
        return gating_mag(s64, gy, idx, rsf, eps, gn)
    s = s64.detach()
    gs = (f32(rsf) * gy.detach().double()).abs()
    e = idx.long()
    if norm_type == 2 or renorm == 1:
        wp = s.gather(1, e)
        D = (f32(eps) + wp.sum(1, keepdim=True)).abs()
        beta = (wp.abs() / D * gs).sum(1, keepdim=True)
        gp = (gs + beta) / D
    else:
        gp = gs
    G = torch.zeros_like(s).scatter_add_(1, e, gp)
    if gn is not None:
        G = G + gn.double().abs()
    if norm_type == 0:
        return s * (G + (s * G).sum(1, keepdim=True))
    return torch.where(s > 0, -torch.expm1(-s * s) / (2 * s), torch.zeros_like(s)) * G


NORM_CFGS = [
    pytest.param(dict(M=16, N=32, k=4, bias=True, k_group=2, group_count=4, rsf=2.5,
                      eps=1e-20, out_flag=False), id="groups"),
    pytest.param(dict(M=8, N=8, k=8, bias=False, k_group=1, group_count=1, rsf=-1.5,
                      eps=0.3, out_flag=True), id="K-eq-N"),
    pytest.param(dict(M=9, N=2, k=1, bias=True, k_group=1, group_count=1, rsf=1.0, eps=1e-10,
                      out_flag=True), id="N2-K1"),
    pytest.param(dict(M=6, N=257, k=7, bias=True, k_group=1, group_count=1, rsf=0.1, eps=1e-6,
                      out_flag=False), id="N257-odd"),
    pytest.param(dict(M=3, N=2048, k=8, bias=False, k_group=1, group_count=1, rsf=1.0,
                      eps=1e-20, out_flag=True), id="N2048"),
    pytest.param(dict(M=0, N=16, k=3, bias=False, k_group=1, group_count=1, rsf=1.0, eps=1e-20,
                      out_flag=True), id="M0"),
]


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("norm_type,renorm", [(0, 0), (0, 1), (2, 0)],
                         ids=["softmax", "softmax-renorm", "sqrt-softplus"])
@pytest.mark.parametrize("cfg", NORM_CFGS)
def test_gating_every_norm_type_autograd(gen, cfg, norm_type, renorm, dtype):
    """D22: softmax (renorm 0/1) and sqrt-softplus gradients against float64 autograd of the
    forward formula, with random upstream gradients into y and (out_flag) norm_out."""
    M, N, k = cfg["M"], cfg["N"], cfg["k"]
    x = randn(gen, M, N, dtype=dtype, scale=2.0).requires_grad_()
    bias = randn(gen, N, dtype=dtype, scale=0.02) if cfg["bias"] else None
    y, idx, norm_out = moegrad.moe_gating_top_k(
        x, k, bias=bias, k_group=cfg["k_group"], group_count=cfg["group_count"],
        renorm=renorm, norm_type=norm_type, out_flag=cfg["out_flag"],
        routed_scaling_factor=cfg["rsf"], eps=cfg["eps"])
    gy = upstream(gen, M, k, dtype=dtype)
    gn = upstream(gen, M, N) if cfg["out_flag"] else None
    loss = (y.float() * gy.float()).sum()
    if gn is not None:
        loss = loss + (norm_out * gn).sum()
    loss.backward()

    x64 = x.detach().double().requires_grad_()
    y64, s64 = gating_ref_any(x64, idx, cfg["rsf"], cfg["eps"], norm_type, renorm)
    loss64 = (y64 * gy.double()).sum()
    if gn is not None:
        loss64 = loss64 + (s64 * gn.double()).sum()
    loss64.backward()
    assert x.grad.dtype == dtype and x.grad.shape == (M, N)
    assert_close_tol(x.grad, x64.grad, dtype, what="grad_x", n_reduce=k,
                     scale=gating_mag_any(s64, gy.double(), idx, cfg["rsf"], cfg["eps"],
                                          norm_type, renorm, gn))


@pytest.mark.parametrize("norm_type,renorm", [(0, 0), (0, 1), (2, 0), (2, 1)])
def test_gating_backward_op_every_norm_type(gen, norm_type, renorm):
    """The backward op called directly (x_norm = the forward's scores) equals float64 autograd
    w.r.t. the logits; repeated ids are summed (D1, D22)."""
    M, N, K = 7, 40, 6
    x64 = randn(gen, M, N, dtype=F64, scale=1.5)
    idx = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(M)]).to(I32)
    idx[0, 1] = idx[0, 0]  # a repeated id
    x_norm = normalise64(x64, norm_type).float()
    gy = upstream(gen, M, K)
    xl = x64.clone().requires_grad_()
    y64, s64 = gating_ref_any(xl, idx, 2.5, 1e-10, norm_type, renorm)
    (y64 * gy.double()).sum().backward()
    gx = moegrad.moe_gating_top_k_backward(x_norm, gy, idx, renorm=renorm, norm_type=norm_type,
                                           routed_scaling_factor=2.5, eps=1e-10)
    assert_close_tol(gx, xl.grad, F32, what="grad_x", n_reduce=K,
                     scale=gating_mag_any(s64, gy.double(), idx, 2.5, 1e-10, norm_type, renorm))


def test_gating_backward_op_matches_autograd(gen):
    """The seed backward op called directly equals torch autograd of the §1.5 formula."""
    M, N, K = 7, 40, 6
    x64 = randn(gen, M, N, dtype=F64, scale=1.5).requires_grad_()
    idx = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(M)]).to(I32)
    s = torch.sigmoid(x64)
    x_norm = s.detach().float()
    gy = upstream(gen, M, K)
    # autograd w.r.t. the logits whose sigmoid is exactly x_norm (fp32 values)
    xl = torch.logit(x_norm.double()).requires_grad_()
    y64, _ = gating_ref(xl, idx, 2.5, 1e-10)
    (y64 * gy.double()).sum().backward()
    gx = moegrad.moe_gating_top_k_backward(x_norm, gy, idx, renorm=0, norm_type=1,
                                           routed_scaling_factor=2.5, eps=1e-10)
    assert_close_tol(gx, xl.grad, F32, what="grad_x", n_reduce=K,
                     scale=gating_mag(x_norm.double(), gy.double(), idx, 2.5, 1e-10))


# ========================================================================== finalize =========

def finalize_ref(ex, idx, x1, x2, bias, scales, eid, mode, R, K):
    """§4.5 with D7/D8/L5 in float64: column layout for modes 0/1, row layout for 2/3;
    dropped (-1) or out-of-rows slots contribute scale * bias only."""
    H = ex.shape[-1]
    ex2 = ex.reshape(-1, H)
    rows = ex2.shape[0]
    out = torch.zeros(R, H, dtype=ex.dtype)
    if x1 is not None:
        out = out + x1
    if x2 is not None:
        out = out + x2
    idx = idx.long()
    r = torch.arange(R)
    for k in range(K):
        pos = k * R + r if mode in (0, 1) else r * K + k
        d = idx[pos]
        valid = (d >= 0) & (d < rows)
        term = torch.where(valid[:, None], ex2[d.clamp(0, max(rows - 1, 0))],
                           torch.zeros((), dtype=ex.dtype))
        if bias is not None:
            term = term + bias[eid[:, k].long()]
        out = out + (scales[:, k:k + 1] if scales is not None else 1.0) * term
    return out


def finalize_mag(ex, idx, x1, x2, bias, scales, eid, mode, R, K, gy):
    """Magnitudes of the terms (conftest `scale`) of out, grad_expanded_x, grad_scales and
    grad_bias: the same formulas on absolute values."""
    a = lambda t: None if t is None else t.detach().double().abs()  # noqa: E731
    ex_a = a(ex).requires_grad_()
    sc_a = a(scales).requires_grad_() if scales is not None else None
    b_a = a(bias).requires_grad_() if bias is not None else None
    out_a = finalize_ref(ex_a, idx, a(x1), a(x2), b_a, sc_a, eid, mode, R, K)
    (out_a * gy.double().abs()).sum().backward()
    mags = (out_a.detach(), ex_a.grad, (sc_a.grad if sc_a is not None else None))
    finalize_mag.bias = b_a.grad if b_a is not None else None
    return mags


def _fin_inputs(g, R, K, H, E, C, mode, dtype, trunc_rows=None):
    if mode in (0, 2):
        ex = randn(g, trunc_rows if trunc_rows is not None else R * K, H, dtype=dtype)
        idx = randperm(g, R * K)
    else:
        ex = randn(g, E, C, H, dtype=dtype)
        idx = torch.randperm(E * C, generator=g)[:R * K].to(I32)
        drop = torch.randperm(R * K, generator=g)[:max(1, R * K // 5)]
        idx[drop] = -1
    return ex, idx


FIN_CFGS = [
    pytest.param(dict(mode=0, K=3, scales=True, bias=True, x1=True, x2=True), id="m0-K3-all"),
    pytest.param(dict(mode=0, K=1, scales=False, bias=False, x1=False, x2=False),
                 id="m0-K1-noscales"),
    pytest.param(dict(mode=0, K=1, scales=True, bias=False, x1=True, x2=False), id="m0-K1-scales"),
    pytest.param(dict(mode=0, K=1, scales=False, bias=False, x1=True, x2=False),
                 id="m0-K1-noscales-x1"),
    pytest.param(dict(mode=0, K=2, scales=False, bias=False, x1=False, x2=False),
                 id="m0-K2-ones-scales"),
    pytest.param(dict(mode=0, K=2, scales=False, bias=True, x1=False, x2=False),
                 id="m0-K2-ones-scales-bias"),
    pytest.param(dict(mode=1, K=2, scales=True, bias=True, x1=True, x2=True), id="m1-K2-all"),
    pytest.param(dict(mode=1, K=1, scales=False, bias=False, x1=False, x2=False),
                 id="m1-K1-noscales"),
    pytest.param(dict(mode=1, K=4, scales=True, bias=False, x1=False, x2=False),
                 id="m1-K4-scales"),
    pytest.param(dict(mode=0, K=2, scales=True, bias=True, x1=False, x2=False, trunc=5),
                 id="m0-L5-truncated-expanded_x"),
    # Row-layout modes are differentiable too (D23).
    pytest.param(dict(mode=2, K=3, scales=True, bias=True, x1=True, x2=True), id="m2-K3-all"),
    pytest.param(dict(mode=2, K=2, scales=False, bias=True, x1=True, x2=False),
                 id="m2-K2-ones-scales-bias"),
    pytest.param(dict(mode=3, K=2, scales=True, bias=True, x1=True, x2=True), id="m3-K2-all"),
    pytest.param(dict(mode=3, K=1, scales=False, bias=False, x1=False, x2=False),
                 id="m3-K1-noscales"),
    pytest.param(dict(mode=1, K=3, scales=False, bias=True, x1=True, x2=False),
                 id="m1-K3-ones-scales-bias-x1"),
]


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cfg", FIN_CFGS)
def test_finalize_autograd(gen, cfg, dtype):
    """Every input that requires grad gets the float64 autograd gradient (D23): expanded_x,
    scales, x1 = x2 = grad_y, bias = per-expert sum (dropped slots included, D7)."""
    R, H, E, C, K, mode = 6, 24, 4, 8, cfg["K"], cfg["mode"]
    ex, idx = _fin_inputs(gen, R, K, H, E, C, mode, dtype, cfg.get("trunc"))
    ex.requires_grad_()
    scales = (rand(gen, R, K, dtype=dtype, lo=0.1, hi=1.0).requires_grad_() if cfg["scales"]
              else None)
    bias = randn(gen, E, H, dtype=dtype).requires_grad_() if cfg["bias"] else None
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32) if cfg["bias"] else None
    x1 = randn(gen, R, H, dtype=dtype).requires_grad_() if cfg["x1"] else None
    x2 = randn(gen, R, H, dtype=dtype).requires_grad_() if cfg["x2"] else None
    out = moegrad.moe_finalize_routing(ex, idx, x1=x1, x2=x2, bias=bias, scales=scales,
                                       expert_idx=eid, drop_pad_mode=mode, k=K)
    assert out.shape == (R, H) and out.dtype == dtype
    gy = upstream(gen, R, H, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for any input (D23)
        out.backward(gy)

    d64 = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    ex64, sc64, b64, x164, x264 = d64(ex), d64(scales), d64(bias), d64(x1), d64(x2)
    ref = finalize_ref(ex64, idx, x164, x264, b64, sc64, eid, mode, R, K)
    (ref * gy.double()).sum().backward()
    m_out, m_ex, m_sc = finalize_mag(ex, idx, x1, x2, bias, scales, eid, mode, R, K, gy)
    m_b = finalize_mag.bias
    assert_close_tol(out, ref.detach(), dtype, what="out", n_reduce=K + 2, scale=m_out)
    assert ex.grad is not None and ex.grad.shape == ex.shape and ex.grad.dtype == dtype
    assert_close_tol(ex.grad, ex64.grad, dtype, what="grad_expanded_x", scale=m_ex)
    if scales is not None:
        assert scales.grad is not None and scales.grad.shape == (R, K)
        assert_close_tol(scales.grad, sc64.grad, dtype, what="grad_scales", n_reduce=H,
                         scale=m_sc)
    for t, t64, name in ((x1, x164, "grad_x1"), (x2, x264, "grad_x2")):
        if t is not None:
            assert t.grad is not None and t.grad.dtype == dtype
            assert torch.equal(t.grad, gy), name  # exactly grad_y
            assert_close_tol(t.grad, t64.grad, dtype, what=name)
    if bias is not None:
        assert bias.grad is not None and bias.grad.shape == (E, H) and bias.grad.dtype == dtype
        assert_close_tol(bias.grad, b64.grad, dtype, what="grad_bias", n_reduce=R * K,
                         scale=m_b)


@pytest.mark.parametrize("which", ["expanded_x", "scales"])
def test_finalize_autograd_partial_requires_grad(gen, which):
    R, K, H, E = 5, 3, 16, 4
    ex, idx = _fin_inputs(gen, R, K, H, E, 0, 0, F32)
    scales = rand(gen, R, K, lo=0.1, hi=1.0)
    bias = randn(gen, E, H)
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32)
    (ex if which == "expanded_x" else scales).requires_grad_()
    out = moegrad.moe_finalize_routing(ex, idx, bias=bias, scales=scales, expert_idx=eid, k=K)
    gy = upstream(gen, R, H)
    out.backward(gy)
    ex64 = ex.detach().double().requires_grad_(which == "expanded_x")
    sc64 = scales.detach().double().requires_grad_(which == "scales")
    ref = finalize_ref(ex64, idx, None, None, bias.double(), sc64, eid, 0, R, K)
    (ref * gy.double()).sum().backward()
    _, m_ex, m_sc = finalize_mag(ex, idx, None, None, bias, scales, eid, 0, R, K, gy)
    if which == "expanded_x":
        assert scales.grad is None
        assert_close_tol(ex.grad, ex64.grad, F32, what="grad_expanded_x", scale=m_ex)
    else:
        assert ex.grad is None
        assert_close_tol(scales.grad, sc64.grad, F32, what="grad_scales", n_reduce=H,
                         scale=m_sc)


def test_finalize_int64_index_autograd(gen):
    """D20 on the autograd path: int64 expanded_row_idx gives the same gradients as int32."""
    R, K, H = 4, 2, 8
    ex, idx = _fin_inputs(gen, R, K, H, 3, 0, 0, F32)
    scales = rand(gen, R, K)
    gy = upstream(gen, R, H)
    grads = []
    for ix in (idx, idx.long()):
        e = ex.clone().requires_grad_()
        s = scales.clone().requires_grad_()
        moegrad.moe_finalize_routing(e, ix, scales=s, k=K).backward(gy)
        grads.append((e.grad, s.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("drop_pad_mode", [0, 1, 2, 3])
def test_finalize_zero_tokens_every_input_gets_its_gradient(gen, drop_pad_mode):
    """R = 0 (§7.3): optional inputs with 0 elements count as absent in the forward, yet each
    one that requires grad gets a gradient of its own (empty) shape, as autograd of the formula
    gives it; none is None. The drop-pad bias (E rows) gets its zero per-expert sum."""
    K, H, E, C = 2, 8, 3, 4
    droppad = drop_pad_mode in (1, 3)
    ex = (randn(gen, E, C, H) if droppad else randn(gen, 0, H)).requires_grad_()
    scales = rand(gen, 0, K).requires_grad_()
    x1 = randn(gen, 0, H).requires_grad_()
    bias = randn(gen, E, H).requires_grad_() if drop_pad_mode else None
    eid = torch.zeros(0, K, dtype=I32)
    out = moegrad.moe_finalize_routing(ex, torch.zeros(0, dtype=I32), x1=x1, bias=bias,
                                       scales=scales, expert_idx=eid,
                                       drop_pad_mode=drop_pad_mode, k=K)
    assert out.shape == (0, H)
    out.backward(torch.zeros(0, H))
    want = [(ex, ex.shape), (scales, (0, K)), (x1, (0, H))] + ([(bias, (E, H))] if bias is not None
                                                              else [])
    for t, shape in want:
        assert t.grad is not None and t.grad.shape == shape and t.grad.dtype == t.dtype
        assert torch.count_nonzero(t.grad) == 0


def test_finalize_only_x1_x2_bias_require_grad(gen):
    """D23: only x1, x2 and bias differentiable -> their true gradients, no warning, and the
    V2Grad op is not needed."""
    R, K, H, E, C = 5, 2, 8, 3, 4
    ex, idx = _fin_inputs(gen, R, K, H, E, C, 1, F32)
    x1 = randn(gen, R, H).requires_grad_()
    x2 = randn(gen, R, H).requires_grad_()
    bias = randn(gen, E, H).requires_grad_()
    scales = rand(gen, R, K)
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32)
    out = moegrad.moe_finalize_routing(ex, idx, x1=x1, x2=x2, bias=bias, scales=scales,
                                       expert_idx=eid, drop_pad_mode=1, k=K)
    gy = upstream(gen, R, H)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out.backward(gy)
    assert torch.equal(x1.grad, gy) and torch.equal(x2.grad, gy)
    ref = torch.zeros(E, H, dtype=F64)
    for r in range(R):
        for k in range(K):  # dropped slots (index -1) keep their bias term (D7)
            ref[eid[r, k]] += scales[r, k].double() * gy[r].double()
    assert_close_tol(bias.grad, ref, F32, what="grad_bias", n_reduce=R * K)


def test_finalize_bias_grad_op_deterministic_and_int64(gen):
    """The bias-gradient op: bitwise equal for 1 and 2 threads (D16) and for int64 ids (D20)."""
    from _util_validation import threads
    R, K, H, E = 300, 4, 96, 6
    gy, sc = upstream(gen, R, H, dtype=BF16), rand(gen, R, K)
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32)
    op = torch.ops.moegrad.moe_finalize_routing_bias_grad
    with threads(1):
        a = op(gy, eid, sc, E)
    with threads(2):
        b = op(gy, eid.long(), sc, E)
    assert a.dtype == BF16 and torch.equal(a, b)


def test_finalize_grad_op_matches_autograd_row_layout(gen):
    """The V2Grad op called directly (row layout, D8) equals the autograd of the formula."""
    R, K, H, E = 5, 3, 12, 4
    ex = randn(gen, R * K, H)
    idx_row = randperm(gen, R * K)
    scales = rand(gen, R, K)
    bias = randn(gen, E, H)
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32)
    gy = upstream(gen, R, H)
    gex, gs = moegrad.moe_finalize_routing_grad(gy, idx_row, ex, scales, eid, bias,
                                                drop_pad_mode=0)
    ex64 = ex.double().requires_grad_()
    sc64 = scales.double().requires_grad_()
    ref = finalize_ref(ex64, idx_row, None, None, bias.double(), sc64, eid, 2, R, K)
    (ref * gy.double()).sum().backward()
    _, m_ex, m_sc = finalize_mag(ex, idx_row, None, None, bias, scales, eid, 2, R, K, gy)
    assert_close_tol(gex, ex64.grad, F32, what="grad_expanded_x", scale=m_ex)
    assert_close_tol(gs, sc64.grad, F32, what="grad_scales", n_reduce=H, scale=m_sc)


# ============================================================================= swiglu ========

def swiglu_ref(x, w, trunc, c):
    """SwiGLU(x)·w with clamp (strict-inequality gradient masks, D11) and truncation, float64."""
    H = x.shape[-1] // 2
    x0, x1 = x[..., :H], x[..., H:]
    c = f32(c)
    if c > 0:
        cc = torch.tensor(c, dtype=x.dtype)
        x0c = torch.where(x0 < c, x0, cc)
        x1c = torch.where((x1 > -c) & (x1 < c), x1, x1.detach().clamp(-c, c))
    else:
        x0c, x1c = x0, x1
    y = F.silu(x0c) * x1c
    lead = x.shape[:-1]
    if w is not None:
        y = y * w.reshape(lead).unsqueeze(-1)
    T = 1
    for d in lead:
        T *= d
    keep = (torch.arange(T) < trunc).reshape(lead).unsqueeze(-1)
    return torch.where(keep, y, torch.zeros((), dtype=x.dtype))


def swiglu_mag(gy, x, w, c):
    """Magnitudes of the gradient terms (reference.swiglu_backward_magnitude), as tensors."""
    y_o = swiglu_ref(x.detach().double(), None, 1 << 62, c)
    gx, gw = refm.swiglu_backward_magnitude(gy.detach(), x.detach(),
                                            None if w is None else w.detach(), y_o,
                                            None, c)
    return torch.from_numpy(gx), (None if gw is None else torch.from_numpy(gw))


def _trunc(group_index, T):
    if group_index is None:
        return T
    return max(0, min(sum(int(v) for v in group_index.reshape(-1).tolist()), T))  # exact sum


SWIGLU_CFGS = [
    pytest.param(dict(lead=(10,), H=24, weight="T", gi=[3, 0, 4], clamp=-1.0), id="2d-w-trunc7"),
    pytest.param(dict(lead=(10,), H=24, weight="T", gi=None, clamp=1.5, exact=True),
                 id="2d-clamp-exact-limits"),
    pytest.param(dict(lead=(2, 5), H=16, weight="BS", gi=None, clamp=-1.0), id="3d-w-BS"),
    pytest.param(dict(lead=(8,), H=12, weight="T1", gi=[5, -2, 9], clamp=0.75),
                 id="w-T1-L8-neg-groups-over-T"),
    pytest.param(dict(lead=(7,), H=20, weight=None, gi=None, clamp=-1.0), id="no-weight"),
    pytest.param(dict(lead=(4,), H=257, weight="T", gi=[3], clamp=2.0), id="odd-H257"),
    pytest.param(dict(lead=(6,), H=8, weight="T", gi=[], clamp=-1.0), id="empty-group_index"),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", SWIGLU_CFGS)
def test_swiglu_autograd(gen, cfg, dtype):
    lead, H, c = cfg["lead"], cfg["H"], cfg["clamp"]
    T = 1
    for d in lead:
        T *= d
    x = randn(gen, *lead, 2 * H, dtype=dtype, scale=1.5)
    if cfg.get("exact"):
        xf = x.view(-1, 2 * H)
        xf[0, :4] = c            # x0 exactly at the limit: gradient masked
        xf[1, H:H + 3] = c       # x1 exactly at +c
        xf[2, H + 1:H + 4] = -c  # x1 exactly at -c
        xf[3, 0] = c + 1.0       # x0 above the limit
    x.requires_grad_()
    w_shape = {"T": (T,), "BS": lead, "T1": (T, 1), None: None}[cfg["weight"]]
    w = rand(gen, *w_shape, lo=0.2, hi=1.5).requires_grad_() if w_shape is not None else None
    gi = torch.tensor(cfg["gi"], dtype=I64) if cfg["gi"] is not None else None
    y = moegrad.swiglu_group(x, weight=w, group_index=gi, clamp_limit=c)
    assert y.shape == (*lead, H) and y.dtype == dtype
    gy = upstream(gen, *lead, H, dtype=dtype)
    y.backward(gy)

    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_() if w is not None else None
    ref = swiglu_ref(x64, w64, _trunc(gi, T), c)
    (ref * gy.double()).sum().backward()
    m_x, m_w = swiglu_mag(gy, x, w, c)
    assert_close_tol(y, ref.detach(), dtype, what="y", scale=ref.detach().abs())
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    assert_close_tol(x.grad, x64.grad, dtype, what="grad_x", scale=m_x)
    if w is not None:
        assert w.grad is not None and w.grad.shape == w.shape and w.grad.dtype == F32
        if dtype == F32:
            assert_close_tol(w.grad, w64.grad, F32, what="grad_weight", n_reduce=H, scale=m_w)
        else:
            # y_origin, the backward's input, is an x-dtype tensor (§5.3, D10): the exact
            # gradient of the library's computation sums grad_y * rounded(y_origin).
            y_o = swiglu_ref(x.detach().double(), None, _trunc(gi, T), c).to(dtype).double()
            gw = (gy.double() * y_o).sum(-1).reshape(w.shape)
            assert_close_tol(w.grad, gw, dtype, what="grad_weight", n_reduce=H, scale=m_w)
    if cfg.get("exact"):
        xg = x.grad.view(-1, 2 * H)
        assert torch.count_nonzero(xg[0, :4]) == 0
        assert torch.count_nonzero(xg[1, H:H + 3]) == 0
        assert torch.count_nonzero(xg[2, H + 1:H + 4]) == 0
        assert xg[3, 0] == 0


def test_swiglu_weight_only_requires_grad(gen):
    """Only the weight is differentiable: D10 (its gradient uses the unweighted activation)."""
    T, H = 9, 16
    x = randn(gen, T, 2 * H)
    w = rand(gen, T, lo=0.2, hi=2.0).requires_grad_()
    y = moegrad.swiglu_group(x, weight=w)
    gy = upstream(gen, T, H)
    y.backward(gy)
    x64 = x.double()
    w64 = w.detach().double().requires_grad_()
    (swiglu_ref(x64, w64, T, -1.0) * gy.double()).sum().backward()
    _, m_w = swiglu_mag(gy, x, w, -1.0)
    assert_close_tol(w.grad, w64.grad, F32, what="grad_weight", n_reduce=H, scale=m_w)


def test_swiglu_backward_op_matches_autograd(gen):
    """The seed backward op called directly, y_origin = unweighted activation (D10)."""
    T, H, c = 11, 20, 1.25
    x = randn(gen, T, 2 * H, scale=1.5)
    w = rand(gen, T, lo=0.2, hi=1.5)
    gi = torch.tensor([4, 3], dtype=I64)
    gy = upstream(gen, T, H)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    (swiglu_ref(x64, w64, 7, c) * gy.double()).sum().backward()
    y_origin = swiglu_ref(x.double(), None, T, c).float()
    gx, gw = moegrad.swiglu_group_quant_backward(gy, x, weight=w, y_origin=y_origin,
                                                 group_index=gi, clamp_limit=c)
    m_x, m_w = swiglu_mag(gy, x, w, c)
    assert_close_tol(gx, x64.grad, F32, what="grad_x", scale=m_x)
    assert_close_tol(gw, w64.grad, F32, what="grad_weight", n_reduce=H, scale=m_w)
    gx2, gw2 = moegrad.swiglu_group_quant_backward(gy, x, group_index=gi, clamp_limit=c)
    assert gw2.shape == (0,) and gw2.dtype == F32
    x64n = x.double().requires_grad_()
    (swiglu_ref(x64n, None, 7, c) * gy.double()).sum().backward()
    m_x2, _ = swiglu_mag(gy, x, None, c)
    assert_close_tol(gx2, x64n.grad, F32, what="grad_x (no weight)", scale=m_x2)


# ===================================================================== end to end ===========

def test_moe_layer_end_to_end_autograd(gen):
    """gating -> swiglu -> finalize chained, gradients w.r.t. logits, token inputs and a
    per-expert input scaling, against the float64 chain of reference formulas."""
    R, N, K, H = 6, 8, 2, 12
    logits = randn(gen, R, N, scale=2.0).requires_grad_()
    y, idx, _ = moegrad.moe_gating_top_k(logits, K, norm_type=1, routed_scaling_factor=1.3)
    # column-layout expanded_row_idx from a stable sort by expert (D8)
    flat_e = idx.t().reshape(-1).long()
    order = torch.argsort(flat_e, stable=True)
    row_idx = torch.empty_like(order)
    row_idx[order] = torch.arange(R * K)
    tok = order % R
    h = randn(gen, R, 2 * H).requires_grad_()
    w_exp = randn(gen, N, 2 * H).requires_grad_()       # a per-expert (diagonal) "weight"
    xs = h[tok] * w_exp[flat_e[order]]
    counts = torch.bincount(flat_e, minlength=N)
    act = moegrad.swiglu_group(xs, group_index=counts)
    out = moegrad.moe_finalize_routing(act, row_idx.to(I32), scales=y, k=K)
    gy = upstream(gen, R, H)
    out.backward(gy)

    l64 = logits.detach().double().requires_grad_()
    h64 = h.detach().double().requires_grad_()
    w64 = w_exp.detach().double().requires_grad_()
    y64, s64 = gating_ref(l64, idx, 1.3, 1e-20)
    y64.retain_grad()
    xs64 = h64[tok] * w64[flat_e[order]]
    act64 = swiglu_ref(xs64, None, R * K, -1.0)
    ref = finalize_ref(act64, row_idx, None, None, None, y64, None, 0, R, K)
    (ref * gy.double()).sum().backward()

    # magnitudes of the terms (conftest `scale`)
    m_out, m_act, m_y = finalize_mag(act64, row_idx, None, None, None, y64, None, 0, R, K, gy)
    assert_close_tol(out, ref.detach(), F32, what="out", n_reduce=K, scale=m_out)
    assert_close_tol(logits.grad, l64.grad, F32, what="grad_logits", n_reduce=K * H,
                     scale=gating_mag(s64, m_y, idx, 1.3, 1e-20))
    m_xs, _ = swiglu_mag(m_act, xs64, None, -1.0)
    m_h = torch.zeros(R, 2 * H, dtype=F64).index_add_(
        0, tok, m_xs * w64.detach()[flat_e[order]].abs())
    m_w = torch.zeros(N, 2 * H, dtype=F64).index_add_(
        0, flat_e[order], m_xs * h64.detach()[tok].abs())
    assert_close_tol(h.grad, h64.grad, F32, what="grad_h", n_reduce=K, scale=m_h)
    assert_close_tol(w_exp.grad, w64.grad, F32, what="grad_w_exp", n_reduce=R * K, scale=m_w)
