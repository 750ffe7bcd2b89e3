"""SwiGLU forward (swiglu_group: L8, L9, D9-D12) and SwigluGroupQuantGrad (§5.5, D9-D12, L7, L8)
against the float64 reference, through the public API and through moegrad._C with poisoned
outputs."""

import numpy as np
import pytest
import torch

import moegrad
import reference as ref
from conftest import (TOLERANCES, assert_close_to_ref, dtype_params, poison, randn, ulp,
                      unit_roundoff)

APIS = ("public", "lowlevel")
api_params = pytest.mark.parametrize("api", APIS)
CLAMP = pytest.mark.parametrize("clamp_limit", [-1.0, 1.5], ids=["noclamp", "clamp1.5"])
WEIGHT_SHAPES = pytest.mark.parametrize("wshape", [None, "T", "T1", "BS"],
                                        ids=["noweight", "w[T]", "w[T,1]", "w[B,S]"])


# ---------------------------------------------------------------------------------------------
# runners and builders
# ---------------------------------------------------------------------------------------------
def run_forward(api, x, weight=None, group_index=None, clamp_limit=-1.0):
    if api == "public":
        return moegrad.swiglu_group(x, weight=weight, group_index=group_index,
                                    clamp_limit=clamp_limit)
    y = poison(torch.empty(tuple(x.shape[:-1]) + (x.shape[-1] // 2,), dtype=x.dtype))
    moegrad._C.swiglu_group(x, weight, group_index, clamp_limit, y)
    return y


def run_backward(api, grad_y, x, weight=None, y_origin=None, group_index=None, clamp_limit=-1.0,
                 want_grad_weight=True):
    if api == "public":
        return moegrad.swiglu_group_quant_backward(grad_y, x, weight=weight, y_origin=y_origin,
                                                   group_index=group_index,
                                                   clamp_limit=clamp_limit)
    gx = poison(torch.empty(tuple(x.shape), dtype=x.dtype))
    gw = None
    if weight is not None and want_grad_weight:
        gw = poison(torch.empty(tuple(weight.shape), dtype=torch.float32))
    moegrad._C.swiglu_group_quant_backward(grad_y, x, weight, y_origin, group_index, clamp_limit,
                                           gx, gw)
    return gx, gw


def make_case(rng, dtype, wshape, H=None, T=None, std=2.0):
    """x [.., 2H] (3-D [B,S,2H] for w[B,S], else [T,2H]), weight fp32 of the asked shape,
    grad_y and a random y_origin (the operator must use the y_origin it is given)."""
    H = H if H is not None else int(rng.choice([1, 7, 16, 33, 257]))
    if wshape == "BS":
        B, S = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        lead, wsh = (B, S), (B, S)
    else:
        T = T if T is not None else int(rng.integers(1, 40))
        lead = (T,)
        wsh = {None: None, "T": (T,), "T1": (T, 1)}[wshape]
    x = randn(lead + (2 * H,), dtype, rng, std=std)
    weight = None if wsh is None else randn(wsh, torch.float32, rng)
    grad_y = randn(lead + (H,), dtype, rng)
    y_origin = randn(lead + (H,), dtype, rng) if weight is not None else None
    return x, weight, grad_y, y_origin


def check_forward(y, x, weight=None, group_index=None, clamp_limit=-1.0):
    assert y.dtype == x.dtype and tuple(y.shape) == tuple(x.shape[:-1]) + (x.shape[-1] // 2,)
    expected = ref.swiglu_group(x, weight, group_index, clamp_limit)
    assert_close_to_ref(y, expected, x.dtype, what="y")


def check_backward(out, grad_y, x, weight=None, y_origin=None, group_index=None,
                   clamp_limit=-1.0, grad_weight_expected=True):
    gx, gw = out
    exp_gx, exp_gw = ref.swiglu_group_quant_backward(grad_y, x, weight, y_origin, group_index,
                                                     clamp_limit)
    mag_gx, mag_gw = ref.swiglu_backward_magnitude(grad_y, x, weight, y_origin, group_index,
                                                   clamp_limit)
    assert gx.dtype == x.dtype and tuple(gx.shape) == tuple(x.shape)
    assert_close_to_ref(gx, exp_gx, x.dtype, scale=mag_gx, what="grad_x")
    if weight is not None and grad_weight_expected:
        assert gw.dtype == torch.float32 and tuple(gw.shape) == tuple(weight.shape)
        H = grad_y.shape[-1]
        assert_close_to_ref(gw, exp_gw, torch.float32, scale=mag_gw, n_reduce=H,
                            what="grad_weight")


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
@api_params
@CLAMP
@WEIGHT_SHAPES
@dtype_params
def test_swiglu_forward_random_matches_reference(dtype, wshape, clamp_limit, api, rng):
    x, weight, _, _ = make_case(rng, dtype, wshape)
    check_forward(run_forward(api, x, weight, clamp_limit=clamp_limit), x, weight,
                  clamp_limit=clamp_limit)


GROUP_CASES = ["none", "below", "equal", "above", "empty", "negative_entry", "negative_sum"]


def group_index_for(case, T, rng):
    if case == "none":
        return None
    if case == "empty":
        return torch.zeros((0,), dtype=torch.int64)
    if case == "negative_sum":
        return torch.tensor([1, -5, 2], dtype=torch.int64)
    target = {"below": int(rng.integers(0, T)), "equal": T,
              "above": T + int(rng.integers(1, 100)), "negative_entry": max(T - 3, 0)}[case]
    G = int(rng.integers(1, 6))
    parts = np.diff(np.sort(np.concatenate([[0, target], rng.integers(0, target + 1, G - 1)])))
    if case == "negative_entry":
        parts = np.concatenate([parts, [5, -5]])  # L8: negative entries are summed, not rejected
    gi = torch.from_numpy(parts.astype(np.int64))
    assert int(gi.sum()) == target
    return gi


@api_params
@pytest.mark.parametrize("group_case", GROUP_CASES)
@dtype_params
def test_swiglu_forward_group_index_truncation(dtype, group_case, api, rng):
    T = int(rng.integers(2, 30))
    x, weight, _, _ = make_case(rng, dtype, "T", H=24, T=T)
    gi = group_index_for(group_case, T, rng)
    y = run_forward(api, x, weight, gi)
    check_forward(y, x, weight, gi)
    trunc = ref.swiglu_trunc(T, gi)
    assert torch.all(y[trunc:] == 0), "rows >= sum(group_index) must be zero"


@api_params
@dtype_params
def test_swiglu_forward_zero_tokens(dtype, api):
    y = run_forward(api, torch.zeros((0, 64), dtype=dtype), torch.zeros((0,), dtype=torch.float32))
    assert tuple(y.shape) == (0, 32) and y.dtype == dtype


@api_params
@dtype_params
def test_swiglu_forward_clamp_at_exact_limits(dtype, api):
    c = 1.5
    x0 = [c, -c, c + 0.25, c - 0.25, 3.0, -3.0, 0.5, -0.5]
    x1 = [-c, c, c + 0.25, -c - 0.25, 0.5, -0.5, c, -c]
    x = torch.tensor([x0 + x1, x1 + x0], dtype=dtype)
    for lim in (c, -1.0):
        check_forward(run_forward(api, x, clamp_limit=lim), x, clamp_limit=lim)


@api_params
@dtype_params
def test_swiglu_forward_large_inputs_give_no_nan(dtype, api):
    # +100 / +1000 overflow a naive exp(x) / (1 + exp(x)); -1000 gives exactly silu = -0
    x0 = [100.0, -100.0, 1000.0, -1000.0, 30.0, -30.0]
    x1 = [1.0, 2.0, -1.0, 3.0, 0.5, -2.0]
    x = torch.tensor([x0 + x1], dtype=dtype)
    y = run_forward(api, x)
    assert not torch.isnan(y).any()
    check_forward(y, x)
    assert y[0, 3] == 0.0 and y[0, 0] == 100.0 and y[0, 2] == -1000.0


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
@api_params
@CLAMP
@WEIGHT_SHAPES
@dtype_params
def test_swiglu_backward_random_matches_reference(dtype, wshape, clamp_limit, api, rng):
    x, weight, gy, yo = make_case(rng, dtype, wshape)
    out = run_backward(api, gy, x, weight, yo, clamp_limit=clamp_limit)
    check_backward(out, gy, x, weight, yo, clamp_limit=clamp_limit)
    if weight is None and api == "public":
        gw = out[1]
        assert gw.dtype == torch.float32 and tuple(gw.shape) == (0,), "no weight -> fp32 [0]"


@api_params
@pytest.mark.parametrize("group_case", GROUP_CASES)
@dtype_params
def test_swiglu_backward_group_index_truncation(dtype, group_case, api, rng):
    T = int(rng.integers(2, 30))
    x, weight, gy, yo = make_case(rng, dtype, "T", H=24, T=T)
    gi = group_index_for(group_case, T, rng)
    gx, gw = run_backward(api, gy, x, weight, yo, gi, clamp_limit=2.0)
    check_backward((gx, gw), gy, x, weight, yo, gi, clamp_limit=2.0)
    trunc = ref.swiglu_trunc(T, gi)
    assert torch.all(gx[trunc:] == 0) and torch.all(gw[trunc:] == 0), "rows >= trunc zero"


@api_params
@dtype_params
def test_swiglu_backward_zero_tokens(dtype, api):
    x = torch.zeros((0, 64), dtype=dtype)
    gx, gw = run_backward(api, torch.zeros((0, 32), dtype=dtype), x,
                          torch.zeros((0,), dtype=torch.float32),
                          torch.zeros((0, 32), dtype=dtype))
    assert tuple(gx.shape) == (0, 64) and gx.dtype == dtype
    assert tuple(gw.shape) == (0,) and gw.dtype == torch.float32


@api_params
@dtype_params
def test_swiglu_backward_clamp_masks_gradient_at_exact_limits(dtype, api, rng):
    # D11 / §5.5 step 6: gx0 zero where x0 >= c, gx1 zero where |x1| >= c (strict inequalities)
    c = 1.5
    x0 = [c, -c, c + 0.25, c - 0.25, 3.0, -3.0, 0.5, -0.5]
    x1 = [-c, c, c + 0.25, -c - 0.25, 0.5, -0.5, c, -c]
    x = torch.tensor([x0 + x1, x1 + x0], dtype=dtype)
    gy = randn((2, 8), dtype, rng) + 3.0  # nonzero upstream gradient everywhere
    w = torch.tensor([0.7, -1.3], dtype=torch.float32)
    yo = randn((2, 8), dtype, rng)
    gx, gw = run_backward(api, gy, x, w, yo, clamp_limit=c)
    check_backward((gx, gw), gy, x, w, yo, clamp_limit=c)
    xx = x.double()
    masked0 = xx[:, :8] >= c
    masked1 = xx[:, 8:].abs() >= c
    assert torch.all(gx[:, :8][masked0] == 0) and torch.all(gx[:, 8:][masked1] == 0)
    assert torch.all(gx[:, :8][~masked0] != 0) and torch.all(gx[:, 8:][~masked1] != 0)
    # without clamp nothing is masked
    gx, gw = run_backward(api, gy, x, w, yo, clamp_limit=-1.0)
    check_backward((gx, gw), gy, x, w, yo)


@api_params
@dtype_params
def test_swiglu_backward_large_inputs_give_no_nan(dtype, api, rng):
    x0 = [100.0, -100.0, 1000.0, -1000.0, 30.0, -30.0]
    x1 = [1.0, 2.0, -1.0, 3.0, 0.5, -2.0]
    x = torch.tensor([x0 + x1, x1 + x0], dtype=dtype)
    gy = randn((2, 6), dtype, rng)
    w = torch.tensor([1.5, -0.5], dtype=torch.float32)
    yo = randn((2, 6), dtype, rng)
    gx, gw = run_backward(api, gy, x, w, yo)
    assert not torch.isnan(gx).any() and not torch.isnan(gw).any()
    check_backward((gx, gw), gy, x, w, yo)


@dtype_params
def test_swiglu_backward_lowlevel_without_grad_weight_output(dtype, rng):
    # L7: with a weight, a null grad_weight output means "do not compute it"
    x, weight, gy, yo = make_case(rng, dtype, "T")
    gx, _ = run_backward("lowlevel", gy, x, weight, yo, want_grad_weight=False)
    check_backward((gx, None), gy, x, weight, yo, grad_weight_expected=False)


@api_params
@dtype_params
def test_swiglu_backward_y_origin_without_weight_is_ignored(dtype, api, rng):
    x, _, gy, _ = make_case(rng, dtype, None)
    yo = randn(tuple(gy.shape), dtype, rng)
    gx, _ = run_backward(api, gy, x, None, yo)
    check_backward((gx, None), gy, x)


@dtype_params
def test_swiglu_backward_with_forward_activation_gives_weight_gradient(dtype, rng):
    # D10: y_origin is the UNWEIGHTED activation; grad_weight = sum_h grad_y * y_origin is then
    # d<grad_y, y>/d weight for y = swiglu_group(x, weight)
    x, weight, gy, _ = make_case(rng, dtype, "T1", H=40)
    yo = moegrad.swiglu_group(x, clamp_limit=2.5)
    gx, gw = moegrad.swiglu_group_quant_backward(gy, x, weight=weight, y_origin=yo,
                                                 clamp_limit=2.5)
    check_backward((gx, gw), gy, x, weight, yo, clamp_limit=2.5)
    act = ref.swiglu_group(x, clamp_limit=2.5)  # float64 activation
    exact = (ref.as_f64(gy) * act).sum(-1, keepdims=True)
    # y_origin went through the dtype rounding: each term may be off by the dtype's rtol
    mag = (np.abs(ref.as_f64(gy)) * np.abs(act)).sum(-1, keepdims=True)
    tol = (2 * unit_roundoff(dtype) + TOLERANCES[torch.float32]["ctol"] * 8) * mag + 1e-30
    err = np.abs(ref.as_f64(gw) - exact)
    assert np.all(err <= tol), f"grad_weight vs d<grad_y, y>/d weight: max err {err.max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_forward_and_backward_large_multithreaded(dtype, three_threads, rng):
    T, H = 512, 1024
    x, weight, gy, yo = make_case(rng, dtype, "T", H=H, T=T)
    gi = torch.tensor([200, 250], dtype=torch.int64)  # trunc = 450 < T
    check_forward(run_forward("lowlevel", x, weight, gi, clamp_limit=3.0), x, weight, gi, 3.0)
    out = run_backward("lowlevel", gy, x, weight, yo, gi, clamp_limit=3.0)
    check_backward(out, gy, x, weight, yo, gi, clamp_limit=3.0)


@api_params
@dtype_params
def test_swiglu_forward_infinite_inputs_follow_formula(dtype, api):
    # L11: silu(+inf) = inf, silu(-inf) = -inf * 0 = NaN (as x * sigmoid(x) in PyTorch); with a
    # clamp, min(+inf, c) = c is finite
    inf = float("inf")
    x = torch.tensor([[inf, -inf, 1.0, 2.0, 3.0, 0.5]], dtype=dtype)
    y = run_forward(api, x)
    assert torch.isinf(y[0, 0]) and y[0, 0] > 0 and torch.isnan(y[0, 1])
    check_forward(y, x)
    y = run_forward(api, x, clamp_limit=1.0)
    assert torch.isfinite(y[0, 0])
    check_forward(y, x, clamp_limit=1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_swiglu_forward_every_16bit_gate_value(dtype, rng):
    # Every one of the 65536 bit patterns as the gate (specials, denormals, the largest values),
    # against up values of both signs, small to large, with and without a weight and a clamp:
    # the 16-bit sigmoid (docs/decisions.md L105) within the tolerance everywhere. Prints the
    # largest error in units of the output's last place.
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    big = 1e30 if dtype == torch.bfloat16 else 6e4
    ups = torch.tensor([1.0, -1.0, 0.3, -2.5, 7.0, 1e-3, big, -big], dtype=dtype)
    x = torch.cat([gate.expand(len(ups), -1), ups[:, None].expand(-1, gate.numel())], dim=1)
    weight = torch.tensor(rng.uniform(0.1, 2.0, size=len(ups)), dtype=torch.float32)
    top = float(torch.finfo(dtype).max)
    edge = top * (1 + unit_roundoff(dtype))  # from here on the rounding gives inf
    worst = 0.0
    for w, lim in ((None, -1.0), (weight, -1.0), (weight, 7.0)):
        y = moegrad.swiglu_group(x, weight=w, clamp_limit=lim)
        o, e = ref.as_f64(y), ref.swiglu_group(x, w, clamp_limit=lim)
        # Results past the dtype's range (the reference does not round): inf of the right sign
        # from the rounding edge on, the largest finite value or inf just below it.
        with np.errstate(invalid="ignore"):
            over = np.abs(e) > top
        assert np.all(np.isinf(o[np.abs(e) >= edge]) &
                      (np.sign(o[np.abs(e) >= edge]) == np.sign(e[np.abs(e) >= edge])))
        assert np.all((np.abs(o[over]) == top) | np.isinf(o[over]))
        e = np.where(over, o, e)
        # The math is fp32 (D12), in the reference's order (silu(gate) * up, then * w): left out
        # are the entries where silu(gate) is below fp32's normal range (gate under about -87;
        # fewer significant bits, which a large |up * w| makes visible) and where silu(gate) * up
        # overflows fp32 before w brings it back (the same with the sigmoid of L96).
        g = ref.as_f64(x[:, :gate.numel()])
        g = np.minimum(g, lim) if lim > 0 else g
        u = ref.as_f64(x[:, gate.numel():])
        u = np.clip(u, -lim, lim) if lim > 0 else u
        with np.errstate(invalid="ignore", over="ignore"):
            silu = g * ref.sigmoid(g)
            f32max = float(np.finfo(np.float32).max)
            skip = ((g < -80) & (np.abs(silu) < 2.0 ** -126)) | (np.abs(silu * u) > f32max)
        e = np.where(skip, o, e)
        assert_close_to_ref(y, e, dtype, what="y")
        fin = np.isfinite(o) & np.isfinite(e)
        ulps = np.abs(o[fin] - e[fin]) / ulp(dtype, e[fin])
        worst = max(worst, float(ulps.max()))
    print(f"swiglu_group {dtype}: max error {worst:.4f} ulp of the output over every gate value")
    # The tolerance in output ulps: half an ulp plus 2 * ctol relative (|ref| < 2^bits ulps).
    assert worst <= 0.5 + 2 * TOLERANCES[torch.float32]["ctol"] / unit_roundoff(dtype)


@pytest.mark.parametrize("group,rows", [([2**62 + 10, -2**62], 10),
                                        ([2**63 - 1, 2**63 - 1, -2**63, -2**63 + 3], 1),
                                        ([2**63 - 1] * 4, 12), ([-2**63] * 3 + [5], 0)])
def test_swiglu_row_count_is_the_exact_sum(group, rows, rng):
    """The processed rows are min(max(sum, 0), T) of the exact sum (L8, L202): no saturation of
    the terms or the running sum (the formula shared with the CUDA kernel)."""
    T, H = 12, 16
    x = randn((T, 2 * H), torch.float32, rng)
    gi = torch.tensor(group, dtype=torch.int64)
    y = moegrad.swiglu_group(x, group_index=gi)
    full = moegrad.swiglu_group(x)
    assert torch.equal(y[:rows], full[:rows])
    assert bool((y[rows:] == 0).all())
    gy = randn((T, H), torch.float32, rng)
    gx, _ = moegrad.swiglu_group_quant_backward(gy, x, group_index=gi)
    assert bool((gx[rows:] == 0).all()) and bool((gx[:rows] != 0).any() or rows == 0)
    q, s, _ = moegrad.swiglu_group_quant(x, group_index=gi)
    assert bool((q.view(torch.uint8)[rows:] == 0).all()) and bool((s[rows:] == 0).all())


# ---------------------------------------------------------------------------------------------
# the gradient written over x (L228: moegrad.hf's routed experts on the CPU)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(37, 33), (9, 1), (0, 16), (256, 1024), (2080, 1024)],
                         ids=["odd", "H1", "0rows", "blocks", "streamed"])
@pytest.mark.parametrize("group_case", ["none", "below", "equal"])
@CLAMP
@dtype_params
def test_swiglu_backward_over_x_equals_a_new_output(dtype, clamp_limit, group_case, shape, rng):
    """The kernel reads each row's gate and up before it stores their gradient over them: the
    result written over x is bitwise the one written into a new (poisoned) buffer, rows past the
    groups zeroed, at sizes that take the chunk path (odd H, H = 1), the 64-column block path
    with plain and (outputs of 8 MiB and more, L72) non-temporal stores, and several threads. A non-contiguous x gets a new tensor and is left as it was."""
    from moegrad.ops.swiglu import _swiglu_group_backward_over_x
    T, H = shape
    x, _, gy, _ = make_case(rng, dtype, None, H=H, T=T)
    gi = group_index_for(group_case, T, rng) if T else None
    want, _ = run_backward("lowlevel", gy, x, None, None, gi, clamp_limit)
    over = x.clone()
    got = _swiglu_group_backward_over_x(gy, over, gi, clamp_limit)
    assert got.data_ptr() == over.data_ptr()
    assert torch.equal(got.view(torch.uint8) if T else got, want.view(torch.uint8) if T else want)
    check_backward((got, None), gy, x, None, None, gi, clamp_limit)
    strided = torch.cat([x, x], -1)[:, : 2 * H] if T else x[:, ::1]
    if T:
        assert not strided.is_contiguous()
        before = strided.clone()
        fresh = _swiglu_group_backward_over_x(gy, strided, gi, clamp_limit)
        assert fresh.data_ptr() != strided.data_ptr() and torch.equal(strided, before)
        assert torch.equal(fresh.view(torch.uint8), want.view(torch.uint8))
