"""The execution path of the Python front (docs/architecture.md): one native plan call and one
run call per op, the device checked in stage one, the workspace size honoured, int64 indices
passed to C++ without any host read of their values (docs/decisions.md D20, L13-L19)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moegrad
from moegrad import _C
from moegrad.ops._registry import OPS
from _util_validation import OpRecorder, gen  # noqa: F401  (gen: a seeded torch.Generator)

PARAM_INVALID, FINALIZE = 161002, 561103


def _perm_idx(g, n, dtype):
    return torch.randperm(n, generator=g).to(dtype)


def _calls(g, idx_dtype=torch.int64):
    """One valid call of each public op: (name, function, args, kwargs)."""
    x = torch.randn(16, 32, generator=g)
    x_norm = torch.sigmoid(x)
    gy = torch.randn(16, 4, generator=g)
    eidx = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(16)]).to(idx_dtype)
    ex = torch.randn(32, 8, generator=g)
    ridx = _perm_idx(g, 32, idx_dtype)
    scales = torch.rand(16, 2, generator=g)
    sx = torch.randn(6, 16, generator=g)
    return [
        ("moe_gating_top_k", moegrad.moe_gating_top_k, (x, 4), dict(norm_type=1)),
        ("moe_gating_top_k_backward", moegrad.moe_gating_top_k_backward, (x_norm, gy, eidx), {}),
        ("moe_finalize_routing", moegrad.moe_finalize_routing, (ex, ridx), dict(scales=scales)),
        ("moe_finalize_routing_grad", moegrad.moe_finalize_routing_grad,
         (torch.randn(16, 8, generator=g), ridx, ex, scales), {}),
        ("swiglu_group", moegrad.swiglu_group, (sx,), {}),
        ("swiglu_group_quant_backward", moegrad.swiglu_group_quant_backward,
         (torch.randn(6, 8, generator=g), sx), {}),
        ("swiglu_group_quant", moegrad.swiglu_group_quant, (sx, torch.rand(6)),
         dict(quant_mode=1, round_scale=True, output_origin=True)),
        ("moe_finalize_routing_bias_grad", torch.ops.moegrad.moe_finalize_routing_bias_grad,
         (torch.randn(16, 8, generator=g), eidx[:, :2] % 5, scales, 5), {}),
    ]


N_CALLS = 8


@pytest.mark.parametrize("i", range(N_CALLS))
def test_validation_runs_once_per_op_call(gen, i):
    name, fn, args, kwargs = _calls(gen)[i]
    before = _C._validation_count()
    fn(*args, **kwargs)
    assert _C._validation_count() - before == 1, name


@pytest.mark.parametrize("i", range(N_CALLS))
@pytest.mark.parametrize("which", ["first", "other"])
def test_meta_tensor_in_eager_fails_with_161002(gen, i, which):
    name, fn, args, kwargs = _calls(gen)[i]
    tensors = [j for j, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if which == "other" and len(tensors) == 1:
        pytest.skip("single tensor argument")
    pos = tensors[0] if which == "first" else tensors[-1]
    args = list(args)
    args[pos] = args[pos].to("meta")
    with pytest.raises(moegrad.MoeError) as e:
        fn(*args, **kwargs)
    assert e.value.code == PARAM_INVALID, str(e.value)
    assert "meta" in str(e.value) and name in str(e.value)


def test_workspace_smaller_than_planned_is_refused(gen):
    ex = torch.randn(24, 40, generator=gen)
    idx = _perm_idx(gen, 24, torch.int32)
    scales = torch.rand(8, 3, generator=gen)
    plan, specs, ws_bytes = _C.plan_moe_finalize_routing(ex, idx, None, None, None, scales, None,
                                                         0, 1)
    assert specs == [([8, 40], 0)]
    assert ws_bytes > 0
    out = torch.full((8, 40), float("nan"))
    with pytest.raises(moegrad.MoeError) as e:
        _C.run(plan, [out], torch.empty(ws_bytes - 1, dtype=torch.uint8), 0)
    assert e.value.code == PARAM_INVALID and "workspace" in str(e.value)
    assert torch.isnan(out).all(), "a refused run wrote to its output"
    with pytest.raises(moegrad.MoeError):
        _C.run(plan, [out], torch.empty(ws_bytes, dtype=torch.uint8), 0)  # a plan runs once
    plan, _, ws_bytes = _C.plan_moe_finalize_routing(ex, idx, None, None, None, scales, None, 0, 1)
    _C.run(plan, [out], torch.empty(ws_bytes, dtype=torch.uint8), 0)
    want = moegrad.moe_finalize_routing(ex, idx, scales=scales)
    assert torch.equal(out, want)


def test_bound_outputs_are_checked_against_the_plan(gen):
    x = torch.randn(6, 16, generator=gen)
    plan, specs, ws = _C.plan_swiglu_group(x, None, None, -1.0)
    assert specs == [([6, 8], 0)]
    with pytest.raises(moegrad.MoeError) as e:
        _C.run(plan, [torch.empty(6, 9)], None, 0)
    assert e.value.code == 561002 and "y" in str(e.value)


@pytest.mark.parametrize("i", [1, 2, 3])
def test_int64_indices_reach_cpp_without_a_host_read(gen, i):
    calls64 = _calls(torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,),
                                                                    generator=gen))))
    name, _, args, kwargs = calls64[i]
    impl = OPS[name]._init_fn  # the op's eager body, under the recorder
    rec = OpRecorder()
    with rec:
        out64 = impl(*args, **kwargs)
    reads = [op for op in rec.ops
             if any(k in op for k in ("_local_scalar_dense", "aten.min", "aten.max", "_to_copy",
                                      "aten.copy"))]
    assert not reads, f"{name} read or converted index values on the host: {reads}"
    args32 = [a.to(torch.int32) if isinstance(a, torch.Tensor) and a.dtype == torch.int64 else a
              for a in args]
    out32 = impl(*args32, **kwargs)
    out64 = out64 if isinstance(out64, tuple) else (out64,)
    out32 = out32 if isinstance(out32, tuple) else (out32,)
    for a, b in zip(out64, out32):
        assert torch.equal(a, b), name


def test_int64_outside_int32_names_position_and_value(gen):
    idx = _perm_idx(gen, 8, torch.int64)
    pos = int(torch.randint(0, 8, (1,), generator=gen))
    bad = (1 << 32) + int(idx[pos])
    idx[pos] = bad
    with pytest.raises(moegrad.MoeError) as e:
        moegrad.moe_finalize_routing(torch.randn(8, 4), idx, scales=torch.rand(4, 2))
    assert e.value.code == FINALIZE
    assert str(bad) in str(e.value) and f"position {pos}" in str(e.value)


# ---------------------------------------------------------------------------------------------
# L104: a plain eager call runs the op's body without a trip through the dispatcher; anything the
# dispatcher has work for (autograd, modes, tracing, the profiler) still goes through it.
# ---------------------------------------------------------------------------------------------
class _CountingPacket:
    def __init__(self, packet):
        self.packet, self.calls = packet, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.packet(*args, **kwargs)


def _count_packet(monkeypatch, name):
    op = OPS[name]
    counter = _CountingPacket(op._packet)
    monkeypatch.setattr(op, "_packet", counter)
    return counter


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("i", range(N_CALLS - 1))  # the last one calls torch.ops directly
def test_plain_call_skips_the_dispatcher_with_the_same_result(monkeypatch, gen, i):
    name, fn, args, kwargs = _calls(gen)[i]
    counter = _count_packet(monkeypatch, name)
    got = _flat(fn(*args, **kwargs))
    assert counter.calls == 0, name
    if name == "swiglu_group_quant":
        want = _flat(torch.ops.moegrad.swiglu_group_quant(
            *args, None, None, 292, 1, 0, True, -1.0, 15.0, True))
    else:
        want = _flat(getattr(torch.ops.moegrad, name)(*args, **kwargs))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b), name


def test_calls_the_dispatcher_must_see_go_through_it(monkeypatch, gen):
    x = torch.randn(6, 16, generator=gen)
    counter = _count_packet(monkeypatch, "swiglu_group")
    # an input that needs a gradient: the autograd kernel records the graph
    xg = x.clone().requires_grad_()
    y = moegrad.swiglu_group(xg)
    assert counter.calls == 1 and y.grad_fn is not None
    gy = torch.randn(y.shape, generator=gen)
    y.backward(gy)
    assert xg.grad is not None and xg.grad.shape == x.shape
    # the same input under no_grad needs nothing from the dispatcher
    with torch.no_grad():
        moegrad.swiglu_group(xg)
    assert counter.calls == 1

    # a dispatch mode sees the op
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        moegrad.swiglu_group(x)
    assert counter.calls == 2 and any("moegrad.swiglu_group" in s for s in seen), seen
    # the profiler records the op by name
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        moegrad.swiglu_group(x)
    assert counter.calls == 3
    assert any(e.name == "moegrad::swiglu_group" for e in prof.events())


def test_malformed_argument_gets_the_dispatchers_error(gen):
    x = torch.randn(6, 16, generator=gen)
    with pytest.raises(Exception) as direct:
        moegrad.swiglu_group(x, "not a tensor")
    with pytest.raises(Exception) as via_dispatcher:
        torch.ops.moegrad.swiglu_group(x, "not a tensor")
    assert type(direct.value) is type(via_dispatcher.value)
    assert str(direct.value) == str(via_dispatcher.value)
