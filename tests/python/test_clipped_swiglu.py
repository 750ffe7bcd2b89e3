"""clipped_swiglu / clipped_swiglu_grad, the GPT-OSS SwiGLU (docs/operators.md §9, D32,
L160-L165): against the float64 reference (any dim, both layouts, both clamp modes, group_index,
every dtype with the conftest tolerances, poisoned outputs through the native plan), against
torch.autograd of the forward formula, the masks at exactly +-limit (inclusive here, strict in
swiglu_group), validation codes, opcheck, torch.compile(fullgraph=True) and double backward."""

import numpy as np
import pytest
import torch

import moegrad
import reference as ref
from conftest import assert_close_to_ref, dtype_params, poison, randn
from moegrad.ops import _registry

LAYOUTS = pytest.mark.parametrize("interleaved", [True, False], ids=["inter", "split"])
MODES = pytest.mark.parametrize("clamp_mode", [0, 1], ids=["mode0", "mode1"])
# (shape, dim): the fast path (last dim), a leading dim, a middle dim, rank 1, odd h, h = 1
SHAPES = pytest.mark.parametrize("shape,dim", [
    ((7, 64), -1), ((5, 2 * 257), -1), ((3, 2), -1), ((6, 5, 3), 0), ((3, 4, 5), 1),
    ((2, 3, 4, 6), -2), ((2 * 37,), 0), ((0, 16), -1), ((4, 0), 0)],
    ids=["last", "odd_h", "h1", "dim0", "dim1", "dim-2", "rank1", "zero_rows", "empty"])


def attrs_for(clamp_mode, rng=None):
    if clamp_mode == 1 or rng is None:
        return dict(clamp_mode=clamp_mode)
    # random finite attributes around the GPT-OSS ones
    return dict(alpha=float(rng.uniform(0.5, 2.5)), limit=float(rng.uniform(1.0, 8.0)),
                bias=float(rng.uniform(-1.5, 1.5)), clamp_mode=0)


def make_x(shape, dtype, rng, std=4.0):
    return randn(shape, dtype, rng, std=std)


def run_lowlevel_forward(x, group_index=None, **kw):
    """The native plan run into a poisoned output (every element must be written)."""
    a = dict(dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True, clamp_mode=0)
    a.update(kw)
    plan, specs, ws = moegrad._C.plan_clipped_swiglu(
        _registry._dl(x), _registry._dlo(group_index), a["dim"], a["alpha"], a["limit"],
        a["bias"], a["interleaved"], a["clamp_mode"])
    (shape, _), = specs
    y = poison(torch.empty(shape, dtype=x.dtype))
    assert ws == 0
    moegrad._C.run(plan, [_registry._dl(y)], None, 0)
    return y


def run_lowlevel_backward(grad_y, x, group_index=None, **kw):
    a = dict(dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True, clamp_mode=0)
    a.update(kw)
    plan, specs, _ = moegrad._C.plan_clipped_swiglu_grad(
        _registry._dl(grad_y), _registry._dl(x), _registry._dlo(group_index), a["dim"],
        a["alpha"], a["limit"], a["bias"], a["interleaved"], a["clamp_mode"])
    gx = poison(torch.empty(specs[0][0], dtype=x.dtype))
    moegrad._C.run(plan, [_registry._dl(gx)], None, 0)
    return gx


# ---------------------------------------------------------------------------------------------
# against the float64 reference
# ---------------------------------------------------------------------------------------------
@SHAPES
@MODES
@LAYOUTS
@dtype_params
def test_forward_and_backward_match_reference(dtype, interleaved, clamp_mode, shape, dim, rng):
    x = make_x(shape, dtype, rng)
    kw = dict(dim=dim, interleaved=interleaved, **attrs_for(clamp_mode, rng))
    y = moegrad.clipped_swiglu(x, **kw)
    exp, mag = ref.clipped_swiglu(x, **kw)
    assert y.dtype == dtype and tuple(y.shape) == exp.shape
    assert_close_to_ref(y, exp, scale=mag, what="y")
    assert_close_to_ref(run_lowlevel_forward(x, **kw), exp, scale=mag, what="y (poisoned)")
    gy = randn(y.shape, dtype, rng)  # random upstream gradient
    gx = moegrad.clipped_swiglu_grad(gy, x, **kw)
    exp_gx, mag_gx = ref.clipped_swiglu_grad(gy, x, **kw)
    assert gx.dtype == dtype and tuple(gx.shape) == tuple(x.shape)
    assert_close_to_ref(gx, exp_gx, scale=mag_gx, n_reduce=2, what="grad_x")
    assert_close_to_ref(run_lowlevel_backward(gy, x, **kw), exp_gx, scale=mag_gx, n_reduce=2,
                        what="grad_x (poisoned)")


GROUPS = pytest.mark.parametrize("counts", [[2, 0, 3], [1, -3], [40, 9], [], [3, 2**62, 2**62]],
                                 ids=["truncates", "negative_sum", "above", "empty", "huge"])


@GROUPS
@MODES
@dtype_params
def test_group_index_rows_past_total_are_positive_zero(dtype, clamp_mode, counts, rng):
    x = make_x((9, 4, 6), dtype, rng)
    gi = torch.tensor(counts, dtype=torch.int64)
    kw = dict(dim=1, clamp_mode=clamp_mode)  # pre = 9 rows of the folded view
    rows = ref.swiglu_trunc(9, gi)
    y = run_lowlevel_forward(x, gi, **kw)
    exp, mag = ref.clipped_swiglu(x, gi, **kw)
    assert_close_to_ref(y, exp, scale=mag)
    gy = randn(y.shape, dtype, rng)
    gx = run_lowlevel_backward(gy, x, gi, **kw)
    exp_gx, mag_gx = ref.clipped_swiglu_grad(gy, x, gi, **kw)
    assert_close_to_ref(gx, exp_gx, scale=mag_gx, n_reduce=2)
    for t in (y[rows:], gx[rows:]):
        assert torch.all(t == 0) and not torch.any(torch.signbit(t)), "rows past the total: +0"


def test_worked_example():
    """docs/operators.md §9.7."""
    x = torch.tensor([[0.5, -1.0, 8.0, 2.0]], dtype=torch.float64).float()
    y = moegrad.clipped_swiglu(x)
    assert y[0, 0].item() == 0.0
    assert y[0, 1].item() == pytest.approx(20.999859, abs=2e-6)
    gx = moegrad.clipped_swiglu_grad(torch.ones(1, 2), x)
    np.testing.assert_allclose(gx.double().numpy(), [[0.0, 0.350388, 0.0, 6.999953]], atol=2e-6)
    assert gx[0, 0].item() == 0.0 and gx[0, 2].item() == 0.0


# ---------------------------------------------------------------------------------------------
# against torch.autograd of the forward formula
# ---------------------------------------------------------------------------------------------
def torch_formula(x, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True, clamp_mode=0):
    """The forward written in plain torch ops (float64): the GPT-OSS activation on the folded
    view [pre, 2h]."""
    d = dim % x.dim()
    pre = int(np.prod(x.shape[:d])) if d else 1
    xf = x.reshape(pre, -1)
    if interleaved:
        a, b = xf[:, ::2], xf[:, 1::2]
    else:
        a, b = xf.chunk(2, dim=1)
    b = b.clamp(-limit, limit)
    if clamp_mode == 0:
        a = a.clamp(max=limit)
        y = a * torch.sigmoid(a * alpha) * (b + bias)
    else:
        y = torch.clamp(a * torch.sigmoid(a), max=limit) * b
    shape = list(x.shape)
    shape[d] //= 2
    return y.reshape(shape)


@pytest.mark.parametrize("shape,dim", [((6, 40), -1), ((4, 6, 5), 1), ((8, 3), 0)],
                         ids=["last", "dim1", "dim0"])
@MODES
@LAYOUTS
def test_autograd_matches_torch_autograd_of_formula(interleaved, clamp_mode, shape, dim, rng):
    x = make_x(shape, torch.float32, rng, std=5.0)
    kw = dict(dim=dim, interleaved=interleaved, **attrs_for(clamp_mode, rng))
    xm = x.clone().requires_grad_(True)
    y = moegrad.clipped_swiglu(xm, **kw)
    gy = randn(y.shape, torch.float32, rng)
    y.backward(gy)
    xr = x.double().requires_grad_(True)
    yr = torch_formula(xr, **kw)
    yr.backward(gy.double())
    torch.testing.assert_close(y.double(), yr.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xm.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)


@MODES
def test_autograd_with_group_index_gives_zero_gradient_past_total(clamp_mode, rng):
    x = make_x((6, 16), torch.float32, rng).requires_grad_(True)
    gi = torch.tensor([2, 1], dtype=torch.int64)
    y = moegrad.clipped_swiglu(x, gi, clamp_mode=clamp_mode)
    y.backward(randn(y.shape, torch.float32, rng))
    assert torch.all(x.grad[3:] == 0) and torch.any(x.grad[:3] != 0)


# ---------------------------------------------------------------------------------------------
# masks at exactly +-limit: inclusive here (torch.clamp agrees), strict in swiglu_group (D11)
# ---------------------------------------------------------------------------------------------
@dtype_params
def test_masks_at_limit_inclusive_while_swiglu_group_strict(dtype):
    L = 2.0
    gate = [L, 0.5, 0.5, 2.5, 0.5]
    up = [0.5, L, -L, 0.5, 2.5]
    xi = torch.tensor([[v for p in zip(gate, up) for v in p]], dtype=dtype)
    gy = torch.tensor([[1.0, -1.0, 0.75, 1.0, 1.0]], dtype=dtype)
    gx = moegrad.clipped_swiglu_grad(gy, xi, limit=L).float()
    assert gx[0, 0] != 0 and gx[0, 3] != 0 and gx[0, 5] != 0, "at +-limit: kept (inclusive)"
    assert gx[0, 6] == 0 and gx[0, 9] == 0, "beyond the limit: masked"
    # torch.clamp's backward keeps the boundary too
    xr = xi.double().requires_grad_(True)
    torch_formula(xr, limit=L).backward(gy.double())
    assert torch.equal(xr.grad != 0, gx.double() != 0)
    # swiglu_group (split halves x0 | x1) with clamp_limit L on the same values: strict
    xs = torch.tensor([gate + up], dtype=dtype)
    gxs, _ = moegrad.swiglu_group_quant_backward(gy, xs, clamp_limit=L)
    assert gxs[0, 0] == 0 and gxs[0, 6] == 0 and gxs[0, 7] == 0, "at +-limit: masked (strict)"
    assert gxs[0, 5] != 0


def test_mode1_gate_mask_inclusive_at_limit():
    """clamp_mode 1 masks on g = A sigmoid(A) <= limit: choose limit = fp32(A sigmoid(A))."""
    a = torch.tensor([3.0], dtype=torch.float32)
    u = moegrad.clipped_swiglu(torch.tensor([[3.0, 1.0]]), limit=1e6, clamp_mode=1)[0, 0]
    assert u.item() == pytest.approx(float(a * torch.sigmoid(a)), rel=1e-6)
    x = torch.tensor([[3.0, 1.0]])
    gx_at = moegrad.clipped_swiglu_grad(torch.ones(1, 1), x, limit=u.item(), clamp_mode=1)
    gx_below = moegrad.clipped_swiglu_grad(torch.ones(1, 1), x,
                                           limit=float(np.nextafter(np.float32(u.item()),
                                                                    np.float32(0))),
                                           clamp_mode=1)
    assert gx_at[0, 0] != 0, "A sigmoid(A) == limit: kept (inclusive)"
    assert gx_below[0, 0] == 0, "A sigmoid(A) > limit: masked"


# ---------------------------------------------------------------------------------------------
# validation: codes and messages (C++ tests check the poisoned outputs of each rule)
# ---------------------------------------------------------------------------------------------
BAD = [
    (dict(clamp_mode=2), 161002, "clamp_mode"),
    (dict(clamp_mode=1, alpha=1.0), 161002, "alpha"),
    (dict(clamp_mode=1, bias=0.0), 161002, "bias"),
    (dict(dim=2), 161002, "dim"),
    (dict(dim=-3), 161002, "dim"),
    (dict(limit=0.0), 561002, "limit"),
    (dict(limit=-1.0), 561002, "limit"),
    (dict(limit=float("inf")), 561002, "limit"),
    (dict(limit=float("nan")), 561002, "limit"),
    (dict(alpha=float("nan")), 561002, "alpha"),
    (dict(bias=float("-inf")), 561002, "bias"),
]


@pytest.mark.parametrize("kw,code,arg", BAD, ids=[f"{a}-{c}-{i}" for i, (_, c, a) in enumerate(BAD)])
def test_invalid_attributes(kw, code, arg):
    x = torch.randn(3, 8)
    for fn in (lambda: moegrad.clipped_swiglu(x, **kw),
               lambda: moegrad.clipped_swiglu_grad(torch.randn(3, 4), x, **kw)):
        with pytest.raises(moegrad.MoeError) as e:
            fn()
        assert e.value.code == code and f": {arg}:" in str(e.value), str(e.value)


def test_invalid_tensors():
    cases = [
        (lambda: moegrad.clipped_swiglu(torch.randn(3, 7)), 561002, "x"),
        (lambda: moegrad.clipped_swiglu(torch.randn(3, 8).double()), 161002, "x"),
        (lambda: moegrad.clipped_swiglu(torch.randn(())), 161002, "x"),
        (lambda: moegrad.clipped_swiglu(torch.randn(3, 8), torch.tensor([1], dtype=torch.int32)),
         161002, "group_index"),
        (lambda: moegrad.clipped_swiglu(torch.randn(3, 8), torch.ones(1, 1, dtype=torch.int64)),
         561002, "group_index"),
        (lambda: moegrad.clipped_swiglu_grad(torch.randn(3, 5), torch.randn(3, 8)), 561002,
         "grad_y"),
        (lambda: moegrad.clipped_swiglu_grad(torch.randn(3, 4).half(), torch.randn(3, 8)),
         161002, "grad_y"),
    ]
    for fn, code, arg in cases:
        with pytest.raises(moegrad.MoeError) as e:
            fn()
        assert e.value.code == code and f": {arg}:" in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# torch integration
# ---------------------------------------------------------------------------------------------
def test_opcheck(rng):
    from torch.library import opcheck
    x = make_x((5, 12), torch.float32, rng)
    gi = torch.tensor([3], dtype=torch.int64)
    opcheck(torch.ops.moegrad.clipped_swiglu.default, (x, gi), dict(dim=-1, limit=3.0))
    opcheck(torch.ops.moegrad.clipped_swiglu.default, (x,), dict(dim=1, interleaved=False,
                                                                 clamp_mode=1))
    gy = randn((5, 6), torch.float32, rng)
    opcheck(torch.ops.moegrad.clipped_swiglu_grad.default, (gy, x, gi), dict(limit=3.0))
    opcheck(torch.ops.moegrad.clipped_swiglu_grad.default, (gy, x), dict(clamp_mode=1))


@MODES
def test_compile_fullgraph_forward_and_backward(clamp_mode, rng):
    x = make_x((6, 4, 8), torch.float32, rng)

    def f(t):
        return moegrad.clipped_swiglu(t, dim=1, interleaved=False, limit=5.0 + clamp_mode * 2,
                                      clamp_mode=clamp_mode).square().sum()

    xe = x.clone().requires_grad_(True)
    f(xe).backward()
    xc = x.clone().requires_grad_(True)
    torch.compile(f, fullgraph=True, backend="eager")(xc).backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=0, atol=0)


def test_double_backward_raises_naming_the_op(rng):
    x = make_x((4, 8), torch.float64, rng).float().requires_grad_(True)
    y = moegrad.clipped_swiglu(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(moegrad.MoeError, match="clipped_swiglu_grad: double backward") as e:
        g.sum().backward()
    assert e.value.code == 561003


def test_reexported():
    import moegrad.ops
    assert moegrad.ops.clipped_swiglu is moegrad.clipped_swiglu
    assert moegrad.ops.clipped_swiglu_grad is moegrad.clipped_swiglu_grad
