"""torch.library integration: opcheck of every op, fake-tensor shape inference, torch.compile
(fullgraph) of the three forwards with their backward, int64 index tensors (D20) and
non-contiguous inputs (D19) on the public Python path."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moegrad
from _util_validation import gen, noncontig, rand, randn, randperm, upstream  # noqa: F401

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
I32, I64 = torch.int32, torch.int64
OPS = torch.ops.moegrad


def _rows_idx(g, M, N, K, dtype=I32):
    return torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(M)]).to(dtype)


def _droppad_idx(g, n, slots):
    idx = torch.randperm(slots, generator=g)[:n].to(I32)
    idx[torch.randperm(n, generator=g)[:max(1, n // 4)]] = -1
    return idx


# ------------------------------------------------------------------------------ opcheck -----
# Each entry builds (op, args) from a generator. Tensors that should be differentiable are
# created with requires_grad so that opcheck's autograd / aot_dispatch tests exercise the
# registered backward.

def oc_gating_full(g):
    return OPS.moe_gating_top_k.default, (
        randn(g, 6, 16).requires_grad_(), 4, randn(g, 16, scale=0.1), 2, 4, 1, 0, 1, True,
        2.5, 1e-20)


def oc_gating_plain(g):
    return OPS.moe_gating_top_k.default, (randn(g, 5, 8), 2, None, 1, 1, 0, 1, 0, False, 1.0,
                                          1e-20)


def oc_gating_sigmoid_nobias_grad(g):
    return OPS.moe_gating_top_k.default, (randn(g, 5, 8, dtype=BF16).requires_grad_(), 3, None,
                                          1, 1, 0, 0, 1, False, 1.0, 1e-20)


def oc_gating_bwd(g):
    return OPS.moe_gating_top_k_backward.default, (
        rand(g, 6, 16, lo=0.05, hi=0.95), upstream(g, 6, 3), _rows_idx(g, 6, 16, 3), 0, 1, 2.5,
        1e-10)


def oc_gating_bwd_f16_int64(g):
    return OPS.moe_gating_top_k_backward.default, (
        rand(g, 4, 8, lo=0.05, hi=0.95), upstream(g, 4, 2, dtype=F16),
        _rows_idx(g, 4, 8, 2, I64), 0, 1, 1.0, 1e-20)


def oc_gating_defaults_grad(g):
    """Default arguments (softmax, no renorm): the autograd path must work (D22)."""
    return OPS.moe_gating_top_k.default, (randn(g, 6, 16).requires_grad_(), 3)


def oc_gating_softmax_renorm_outflag_grad(g):
    return OPS.moe_gating_top_k.default, (randn(g, 6, 16, dtype=BF16).requires_grad_(), 4,
                                          randn(g, 16, scale=0.1, dtype=BF16), 2, 4, 0, 1, 0,
                                          True, 2.5, 1e-20)


def oc_gating_sqrt_softplus_grad(g):
    return OPS.moe_gating_top_k.default, (randn(g, 5, 8).requires_grad_(), 2, None, 1, 1, 0, 0,
                                          2, True, 1.5, 1e-10)


def oc_gating_bwd_softmax(g):
    x_norm = torch.softmax(randn(g, 6, 16), dim=-1)
    return OPS.moe_gating_top_k_backward.default, (
        x_norm, upstream(g, 6, 3), _rows_idx(g, 6, 16, 3), 1, 0, 2.5, 1e-10)


def oc_gating_bwd_sqrt_softplus(g):
    x_norm = torch.sqrt(torch.nn.functional.softplus(randn(g, 6, 16)))
    return OPS.moe_gating_top_k_backward.default, (
        x_norm, upstream(g, 6, 3, dtype=BF16), _rows_idx(g, 6, 16, 3), 0, 2, 1.0, 1e-20)


def oc_fin_full(g):
    R, K, H, E = 4, 2, 8, 3
    return OPS.moe_finalize_routing.default, (
        randn(g, R * K, H).requires_grad_(), randperm(g, R * K), randn(g, R, H), randn(g, R, H),
        randn(g, E, H), rand(g, R, K).requires_grad_(),
        torch.randint(0, E, (R, K), generator=g).to(I32), 0, K)


def oc_fin_minimal(g):
    return OPS.moe_finalize_routing.default, (randn(g, 8, 8).requires_grad_(), randperm(g, 8),
                                              None, None, None, None, None, 0, 2)


def oc_fin_defaults_only(g):
    """Every optional argument at its default (k = 1): the autograd path must still work."""
    return OPS.moe_finalize_routing.default, (randn(g, 5, 8).requires_grad_(), randperm(g, 5),
                                              None, None, None, None, None, 0, 1)


def oc_fin_droppad(g):
    R, K, H, E, C = 4, 2, 8, 3, 4
    return OPS.moe_finalize_routing.default, (
        randn(g, E, C, H).requires_grad_(), _droppad_idx(g, R * K, E * C), None, None,
        randn(g, E, H), rand(g, R, K).requires_grad_(),
        torch.randint(0, E, (R, K), generator=g).to(I32), 1, K)


def oc_fin_every_grad_rowlayout(g):
    """Mode 2 (row layout) with every differentiable input requiring grad (D23)."""
    R, K, H, E = 4, 2, 8, 3
    return OPS.moe_finalize_routing.default, (
        randn(g, R * K, H).requires_grad_(), randperm(g, R * K), randn(g, R, H).requires_grad_(),
        randn(g, R, H).requires_grad_(), randn(g, E, H).requires_grad_(),
        rand(g, R, K).requires_grad_(), torch.randint(0, E, (R, K), generator=g).to(I32), 2, K)


def oc_fin_droppad_rowlayout_bias_grad(g):
    R, K, H, E, C = 4, 2, 8, 3, 4
    return OPS.moe_finalize_routing.default, (
        randn(g, E, C, H, dtype=BF16), _droppad_idx(g, R * K, E * C), None, None,
        randn(g, E, H, dtype=BF16).requires_grad_(), None,
        torch.randint(0, E, (R, K), generator=g).to(I32), 3, K)


def oc_fin_bias_grad(g):
    R, K, H, E = 6, 3, 8, 4
    return OPS.moe_finalize_routing_bias_grad.default, (
        upstream(g, R, H), torch.randint(0, E, (R, K), generator=g).to(I32), rand(g, R, K), E)


def oc_fin_grad_full(g):
    R, K, H, E = 4, 2, 8, 3
    return OPS.moe_finalize_routing_grad.default, (
        upstream(g, R, H), randperm(g, R * K), randn(g, R * K, H), rand(g, R, K),
        torch.randint(0, E, (R, K), generator=g).to(I32), randn(g, E, H), 0, 0, 0, 0)


def oc_fin_grad_noscales(g):
    return OPS.moe_finalize_routing_grad.default, (upstream(g, 5, 8), randperm(g, 5), None,
                                                   None, None, None, 0, 0, 0, 0)


def oc_fin_grad_droppad(g):
    R, K, H, E, C = 4, 2, 8, 3, 4
    return OPS.moe_finalize_routing_grad.default, (
        upstream(g, R, H), _droppad_idx(g, R * K, E * C), randn(g, E, C, H), rand(g, R, K),
        None, None, 1, 0, E, C)


def oc_fin_grad_active(g):
    R, K, H = 4, 2, 8
    return OPS.moe_finalize_routing_grad.default, (
        upstream(g, R, H), randperm(g, R * K), randn(g, 5, H), rand(g, R, K), None, None, 0, 5,
        0, 0)


def oc_swiglu_full(g):
    return OPS.swiglu_group.default, (randn(g, 6, 16).requires_grad_(),
                                      rand(g, 6, lo=0.2).requires_grad_(),
                                      torch.tensor([2, 3], dtype=I64), 1.5)


def oc_swiglu_plain(g):
    return OPS.swiglu_group.default, (randn(g, 2, 3, 16, dtype=BF16).requires_grad_(), None,
                                      None, -1.0)


def oc_swiglu_bwd_full(g):
    return OPS.swiglu_group_quant_backward.default, (
        upstream(g, 6, 8), randn(g, 6, 16), rand(g, 6, 1), randn(g, 6, 8),
        torch.tensor([4], dtype=I64), 2.0)


def oc_swiglu_bwd_plain(g):
    return OPS.swiglu_group_quant_backward.default, (upstream(g, 6, 8), randn(g, 6, 16), None,
                                                     None, None, -1.0)


OPCHECK = [oc_gating_full, oc_gating_plain, oc_gating_sigmoid_nobias_grad, oc_gating_bwd,
           oc_gating_bwd_f16_int64, oc_gating_defaults_grad, oc_gating_softmax_renorm_outflag_grad,
           oc_gating_sqrt_softplus_grad, oc_gating_bwd_softmax, oc_gating_bwd_sqrt_softplus, oc_fin_full, oc_fin_minimal, oc_fin_defaults_only,
           oc_fin_droppad, oc_fin_every_grad_rowlayout, oc_fin_droppad_rowlayout_bias_grad,
           oc_fin_bias_grad, oc_fin_grad_full, oc_fin_grad_noscales, oc_fin_grad_droppad,
           oc_fin_grad_active,
           oc_swiglu_full, oc_swiglu_plain, oc_swiglu_bwd_full, oc_swiglu_bwd_plain]


@pytest.mark.parametrize("build", OPCHECK, ids=[f.__name__[3:] for f in OPCHECK])
def test_opcheck(gen, build):
    op, args = build(gen)
    torch.library.opcheck(op, args)


def test_opcheck_covers_all_six_ops():
    names = {f(torch.Generator().manual_seed(0))[0].name() for f in OPCHECK}
    assert names == {f"moegrad::{n}" for n in (
        "moe_gating_top_k", "moe_gating_top_k_backward", "moe_finalize_routing",
        "moe_finalize_routing_grad", "swiglu_group", "swiglu_group_quant_backward",
        "moe_finalize_routing_bias_grad")}


# ----------------------------------------------------------------- fake-tensor inference ----

def _fake(mode, *tensors):
    return [None if t is None else mode.from_tensor(t) for t in tensors]


def test_fake_shapes_gating(gen):
    with FakeTensorMode() as mode:
        x, b = _fake(mode, randn(gen, 7, 32, dtype=BF16), randn(gen, 32, dtype=BF16))
        y, idx, no = OPS.moe_gating_top_k(x, 5, b, 2, 4, 1, 0, 1, True, 1.0, 1e-20)
        assert (y.shape, y.dtype) == ((7, 5), BF16)
        assert (idx.shape, idx.dtype) == ((7, 5), I32)
        assert (no.shape, no.dtype) == ((7, 32), F32)
        xn, gy, ei = _fake(mode, rand(gen, 7, 32), upstream(gen, 7, 5, dtype=F16),
                           _rows_idx(gen, 7, 32, 5))
        gx = OPS.moe_gating_top_k_backward(xn, gy, ei, 0, 1, 1.0, 1e-20)
        assert (gx.shape, gx.dtype) == ((7, 32), F16)   # D15: grad_y's dtype


def test_fake_shapes_finalize(gen):
    R, K, H, E, C = 5, 3, 12, 4, 6
    with FakeTensorMode() as mode:
        ex, idx, sc = _fake(mode, randn(gen, R * K, H, dtype=BF16), randperm(gen, R * K),
                            rand(gen, R, K, dtype=BF16))
        out = OPS.moe_finalize_routing(ex, idx, None, None, None, sc, None, 0, K)
        assert (out.shape, out.dtype) == ((R, H), BF16)
        out = OPS.moe_finalize_routing(ex, idx, None, None, None, None, None, 0, K)
        assert out.shape == (R, H)                       # R = len(idx) // k
        ex3, idx3 = _fake(mode, randn(gen, E, C, H), _droppad_idx(gen, R * K, E * C))
        out = OPS.moe_finalize_routing(ex3, idx3, None, None, None, None, None, 1, K)
        assert (out.shape, out.dtype) == ((R, H), F32)   # H from dim 2 in mode 1
        gy, sc32 = _fake(mode, upstream(gen, R, H), rand(gen, R, K))
        exr, = _fake(mode, randn(gen, R * K, H))
        gex, gs = OPS.moe_finalize_routing_grad(gy, idx, exr, sc32, None, None, 0, 0, 0, 0)
        assert gex.shape == (R * K, H) and gs.shape == (R, K) and gs.dtype == F32
        ex7, = _fake(mode, randn(gen, 7, H))
        gex, _ = OPS.moe_finalize_routing_grad(gy, idx, ex7, sc32, None, None, 0, 7, 0, 0)
        assert gex.shape == (7, H)                       # 0 < active_num < R*K
        gex, _ = OPS.moe_finalize_routing_grad(gy, idx, exr, sc32, None, None, 0, 99, 0, 0)
        assert gex.shape == (R * K, H)                   # active_num >= R*K ignored
        gex, gs = OPS.moe_finalize_routing_grad(gy, idx3, ex3, sc32, None, None, 1, 0, E, C)
        assert gex.shape == (E, C, H) and gs.shape == (R, K)
        gy16, idx1 = _fake(mode, upstream(gen, R, H, dtype=F16), randperm(gen, R))
        gex, gs = OPS.moe_finalize_routing_grad(gy16, idx1, None, None, None, None, 0, 0, 0, 0)
        assert (gex.shape, gex.dtype) == ((R, H), F16)
        assert (gs.shape, gs.dtype) == ((R, 1), F16)     # D5


def test_fake_shapes_swiglu(gen):
    with FakeTensorMode() as mode:
        x, w = _fake(mode, randn(gen, 2, 3, 20, dtype=F16), rand(gen, 2, 3))
        y = OPS.swiglu_group(x, w, None, -1.0)
        assert (y.shape, y.dtype) == ((2, 3, 10), F16)
        gy, yo = _fake(mode, upstream(gen, 2, 3, 10, dtype=F16), randn(gen, 2, 3, 10, dtype=F16))
        gx, gw = OPS.swiglu_group_quant_backward(gy, x, w, yo, None, -1.0)
        assert (gx.shape, gx.dtype) == ((2, 3, 20), F16)
        assert (gw.shape, gw.dtype) == ((2, 3), F32)
        gx, gw = OPS.swiglu_group_quant_backward(gy, x, None, None, None, -1.0)
        assert (gw.shape, gw.dtype) == ((0,), F32)


@pytest.mark.parametrize("build", OPCHECK, ids=[f.__name__[3:] for f in OPCHECK])
def test_fake_matches_real(gen, build):
    """Fake kernels agree with the real outputs in shape, dtype and strides (contiguous)."""
    op, args = build(gen)
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    real = op(*args)
    with FakeTensorMode() as mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = op(*fargs)
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(real) == len(fake)
    for r, f in zip(real, fake):
        assert tuple(r.shape) == tuple(f.shape) and r.dtype == f.dtype
        assert r.is_contiguous() and f.is_contiguous()


# ---------------------------------------------------------------------------- compile ------

def _moe_step(logits, h, w_exp, K, N):
    """A miniature MoE layer: gating -> expert inputs -> swiglu -> finalize."""
    y, idx, _ = moegrad.moe_gating_top_k(logits, K, k_group=2, group_count=4,
                                         group_select_mode=1, norm_type=1,
                                         routed_scaling_factor=1.5)
    R = logits.shape[0]
    flat_e = idx.t().reshape(-1).long()
    order = torch.argsort(flat_e, stable=True)
    row_idx = torch.empty_like(order)
    row_idx.scatter_(0, order, torch.arange(R * K))
    tok = order % R
    xs = h[tok] * w_exp[flat_e[order]]
    counts = torch.zeros(N, dtype=I64).index_add_(0, flat_e, torch.ones_like(flat_e))
    act = moegrad.swiglu_group(xs, weight=None, group_index=counts, clamp_limit=3.0)
    return moegrad.moe_finalize_routing(act, row_idx, scales=y, k=K)


def _leaves(g, R=6, N=16, H=8):
    return (randn(g, R, N, scale=2.0).requires_grad_(), randn(g, R, 2 * H).requires_grad_(),
            randn(g, N, 2 * H).requires_grad_())


def test_compile_fullgraph_forward_then_backward(gen):
    """torch.compile(fullgraph=True) (default inductor backend) of the three forwards; the
    backward of the compiled graph runs the registered backward ops; results match eager."""
    import torch._dynamo
    torch._dynamo.reset()
    R, N, H, K = 6, 16, 8, 3
    gy = upstream(gen, R, H)
    eager = _leaves(gen, R, N, H)
    comp = tuple(t.detach().clone().requires_grad_() for t in eager)

    def f(logits, h, w_exp):
        return _moe_step(logits, h, w_exp, K, N)

    out_e = f(*eager)
    out_e.backward(gy)
    from torch._dynamo.testing import CompileCounterWithBackend
    cnt = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, fullgraph=True, dynamic=False, backend=cnt)
    out_c = cf(*comp)
    out_c.backward(gy)
    assert cnt.frame_count == 1
    code = cnt.graphs[0].code
    for name in ("moe_gating_top_k", "swiglu_group", "moe_finalize_routing"):
        assert name in code, f"{name} missing from the captured graph"
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    for a, b in zip(comp, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_compile_fullgraph_with_backward_inside(gen):
    """A compiled function that runs the forwards AND .backward() in one fullgraph capture
    (dynamo's trace_autograd_ops), aot_eager backend; matches eager bit for bit."""
    import torch._dynamo
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        pytest.skip("this torch cannot trace Tensor.backward() in fullgraph mode")
    torch._dynamo.reset()
    R, N, H, K = 5, 16, 6, 2
    gy = upstream(gen, R, H)
    eager = _leaves(gen, R, N, H)
    comp = tuple(t.detach().clone().requires_grad_() for t in eager)

    def step(logits, h, w_exp, gy):
        out = _moe_step(logits, h, w_exp, K, N)
        out.backward(gy)
        return out.detach()

    out_e = step(*eager, gy)
    from torch._dynamo.testing import CompileCounterWithBackend
    cnt = CompileCounterWithBackend("aot_eager")
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        out_c = torch.compile(step, fullgraph=True, backend=cnt, dynamic=False)(*comp, gy)
    assert cnt.frame_count >= 1
    code = "\n".join(gm.code for gm in cnt.graphs)
    for name in ("moe_gating_top_k", "swiglu_group", "moe_finalize_routing"):
        assert name in code, f"{name} missing from the captured graph"
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    for a, b in zip(comp, eager):
        assert a.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


# --------------------------------------------------------------- D20: int64 index tensors ---

def test_int64_indices_gating_backward(gen):
    xn = rand(gen, 6, 16, lo=0.05, hi=0.95)
    gy = upstream(gen, 6, 4)
    idx = _rows_idx(gen, 6, 16, 4)
    a = moegrad.moe_gating_top_k_backward(xn, gy, idx, routed_scaling_factor=2.0)
    b = moegrad.moe_gating_top_k_backward(xn, gy, idx.long(), routed_scaling_factor=2.0)
    assert torch.equal(a, b) and b.dtype == F32


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_int64_indices_finalize(gen, mode):
    R, K, H, E, C = 5, 2, 8, 3, 4
    ex = randn(gen, R * K, H) if mode in (0, 2) else randn(gen, E, C, H)
    idx = randperm(gen, R * K) if mode in (0, 2) else _droppad_idx(gen, R * K, E * C)
    sc, bias = rand(gen, R, K), randn(gen, E, H)
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32)
    a = moegrad.moe_finalize_routing(ex, idx, bias=bias, scales=sc, expert_idx=eid,
                                     drop_pad_mode=mode)
    b = moegrad.moe_finalize_routing(ex, idx.long(), bias=bias, scales=sc, expert_idx=eid.long(),
                                     drop_pad_mode=mode)
    assert torch.equal(a, b)


@pytest.mark.parametrize("mode", [0, 1])
def test_int64_indices_finalize_grad(gen, mode):
    R, K, H, E, C = 5, 2, 8, 3, 4
    ex = randn(gen, R * K, H) if mode == 0 else randn(gen, E, C, H)
    idx = randperm(gen, R * K) if mode == 0 else _droppad_idx(gen, R * K, E * C)
    sc, bias = rand(gen, R, K), randn(gen, E, H)
    eid = torch.randint(0, E, (R, K), generator=gen).to(I32)
    gy = upstream(gen, R, H)
    kw = dict(drop_pad_mode=mode, expert_num=E if mode else 0, expert_capacity=C if mode else 0)
    a = moegrad.moe_finalize_routing_grad(gy, idx, ex, sc, eid, bias, **kw)
    b = moegrad.moe_finalize_routing_grad(gy, idx.long(), ex, sc, eid.long(), bias, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_int64_topk_indices_into_finalize(gen):
    """The D20 use case: indices straight from torch.topk / argsort (int64)."""
    R, K, H, N = 4, 2, 8, 6
    logits = randn(gen, R, N)
    eid = torch.topk(logits, K).indices                      # int64
    flat_e = eid.t().reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    row_idx = torch.empty_like(order)
    row_idx[order] = torch.arange(R * K)                     # int64
    ex, sc, bias = randn(gen, R * K, H), rand(gen, R, K), randn(gen, N, H)
    out = moegrad.moe_finalize_routing(ex, row_idx, bias=bias, scales=sc, expert_idx=eid)
    out32 = moegrad.moe_finalize_routing(ex, row_idx.int(), bias=bias, scales=sc,
                                         expert_idx=eid.int())
    assert out.dtype == F32 and torch.equal(out, out32)


# ------------------------------------------------------- D19: non-contiguous inputs accepted --

def _nc_all(args):
    return [noncontig(a) if isinstance(a, torch.Tensor) and a.numel() >= 2 else a for a in args]


def _assert_same(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x.view(-1).view(torch.uint8) if x.numel() else x,
                           y.view(-1).view(torch.uint8) if y.numel() else y)


NONCONTIG = [
    ("gating", lambda g: (moegrad.moe_gating_top_k,
                          [randn(g, 6, 16), 4, randn(g, 16, scale=0.1), 2, 4, 1, 0, 1, True, 1.5,
                           1e-20])),
    ("gating_bwd", lambda g: (moegrad.moe_gating_top_k_backward,
                              [rand(g, 6, 16, lo=0.05, hi=0.95), upstream(g, 6, 3),
                               _rows_idx(g, 6, 16, 3), 0, 1, 2.0, 1e-20])),
    ("finalize", lambda g: (moegrad.moe_finalize_routing,
                            [randn(g, 8, 8), randperm(g, 8), randn(g, 4, 8), randn(g, 4, 8),
                             randn(g, 3, 8), rand(g, 4, 2),
                             torch.randint(0, 3, (4, 2), generator=g).to(I32), 0, 2])),
    ("finalize_grad", lambda g: (moegrad.moe_finalize_routing_grad,
                                 [upstream(g, 4, 8), randperm(g, 8), randn(g, 8, 8),
                                  rand(g, 4, 2), torch.randint(0, 3, (4, 2), generator=g).to(I32),
                                  randn(g, 3, 8), 0, 0, 0, 0])),
    ("swiglu", lambda g: (moegrad.swiglu_group,
                          [randn(g, 6, 16), rand(g, 6, 1), torch.tensor([2, 3], dtype=I64), 2.0])),
    ("swiglu_bwd", lambda g: (moegrad.swiglu_group_quant_backward,
                              [upstream(g, 6, 8), randn(g, 6, 16), rand(g, 6), randn(g, 6, 8),
                               torch.tensor([4, 1], dtype=I64), 2.0])),
]


@pytest.mark.parametrize("build", [p[1] for p in NONCONTIG], ids=[p[0] for p in NONCONTIG])
def test_noncontiguous_inputs_match_contiguous(gen, build):
    fn, args = build(gen)
    nc = _nc_all(args)
    assert all(not a.is_contiguous() for a in nc if isinstance(a, torch.Tensor) and a.numel() >= 2)
    _assert_same(fn(*nc), fn(*args))


def test_noncontiguous_autograd(gen):
    """Non-contiguous leaves through the autograd paths: same values and gradients."""
    x = randn(gen, 6, 16)
    y_c, _, _ = moegrad.moe_gating_top_k(x.clone().requires_grad_(), 3, norm_type=1)
    xn = noncontig(x).requires_grad_()
    y_n, _, _ = moegrad.moe_gating_top_k(xn, 3, norm_type=1)
    assert torch.equal(y_c, y_n)
    gy = upstream(gen, 6, 3)
    xc = x.clone().requires_grad_()
    moegrad.moe_gating_top_k(xc, 3, norm_type=1)[0].backward(gy)
    y_n.backward(noncontig(gy))
    assert torch.equal(xc.grad, xn.grad)
    s = randn(gen, 6, 16)
    sc, sn = s.clone().requires_grad_(), noncontig(s).requires_grad_()
    g2 = upstream(gen, 6, 8)
    moegrad.swiglu_group(sc, clamp_limit=1.0).backward(g2)
    moegrad.swiglu_group(sn, clamp_limit=1.0).backward(noncontig(g2))
    assert torch.equal(sc.grad, sn.grad)
