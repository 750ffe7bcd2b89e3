"""torch.library registration of the moegrad operators: custom ops, fake kernels, autograd.

Each op call makes two native calls, the two stages of the C API: ``_C.plan_<op>`` validates
(once), infers the outputs, picks the backend from the tensors' device and sizes the workspace;
Python allocates the outputs and the workspace with torch on the input's device; ``_C.run`` runs
the kernel (without the GIL). See docs/architecture.md.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _C
from ._errors import ERR_FINALIZE_ROUTING, ERR_PARAM_INVALID, MoeError

# DType codes of the native plans (aclDataType values) -> torch dtypes.
_DTYPES = {0: torch.float32, 1: torch.float16, 3: torch.int32, 9: torch.int64,
           27: torch.bfloat16, 35: torch.float8_e5m2, 36: torch.float8_e4m3fn,
           37: torch.float8_e8m0fnu}
# float8 tensors cannot cross DLPack: they are handed to the native run as uint8 views (L26).
_FP8 = (torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e8m0fnu)


def _contig(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


# Tensors reach the native module as DLPack capsules: torch's C converter is about ten times
# cheaper per tensor than Tensor.__dlpack__, which dominated the call at small sizes. A capsule
# does not keep its tensor alive past the native call, so callers keep the tensors referenced
# (the plan holds their addresses until run).
_dl = torch.utils.dlpack.to_dlpack


def _dlo(t: Optional[Tensor]):
    return None if t is None else _dl(t)


def _execute(planned, like: Tensor) -> List[Tensor]:
    """Stage two: allocate the planned outputs and workspace on like's device, then run."""
    plan, specs, ws_bytes = planned
    dev = like.device
    outs = [torch.empty(shape, dtype=_DTYPES[code], device=dev) for shape, code in specs]
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    _C.run(plan, [_dl(o.view(torch.uint8) if o.dtype in _FP8 else o) for o in outs],
           None if ws is None else _dl(ws), stream)
    return outs


def _same_device(op: str, *named) -> None:
    """Fake kernels: every tensor on the first one's device, and that a cpu or cuda one (a real
    meta tensor in eager mode lands here and must fail as the native plan would)."""
    first_name, first = named[0]
    for name, t in named:
        if t is None:
            continue
        if t.device.type not in ("cpu", "cuda"):
            raise MoeError(f"{op}: {name}: tensor must be on cpu or cuda; got {t.device}",
                           ERR_PARAM_INVALID)
        if t.device != first.device:
            raise MoeError(f"{op}: {name}: tensor must be on the device of {first_name} "
                           f"({first.device}); got {t.device}", ERR_PARAM_INVALID)


# ---------------------------------------------------------------------------------------------
# Registration: torch.library.Library define/impl plus register_fake and register_autograd. Same
# schema and behaviour as torch.library.custom_op, but about 2-3 us cheaper per call
# (docs/performance.md, docs/decisions.md L19); opcheck and torch.compile(fullgraph=True) pass.
# ---------------------------------------------------------------------------------------------
_LIB = torch.library.Library("moegrad", "DEF")


class _Op:
    """One operator: defined from its Python body's signature, implemented by the body for every
    device, with register_fake / register_autograd like a custom_op's."""

    def __init__(self, name: str, fn):
        self._name, self._init_fn = name, fn
        self._schema = torch.library.infer_schema(fn, mutates_args=())
        self._abstract_fn = self._backward_fn = self._setup_context_fn = None
        _LIB.define(name + self._schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        self._qualname = f"moegrad::{name}"
        self._packet = getattr(torch.ops.moegrad, name)
        self.__doc__ = fn.__doc__

    def __call__(self, *args, **kwargs):
        # Plain eager call with nothing for the dispatcher to do: run the body directly (L104).
        if _direct_ok(args, kwargs):
            try:
                return self._init_fn(*args, **kwargs)
            except (TypeError, AttributeError):
                pass  # a malformed argument: let the dispatcher's schema check report it
        return self._packet(*args, **kwargs)

    def register_fake(self, fn):
        torch.library.register_fake(self._qualname, fn, lib=_LIB)
        self._abstract_fn = fn
        return fn

    def register_autograd(self, backward, *, setup_context=None):
        torch.library.register_autograd(self._qualname, backward, setup_context=setup_context,
                                        lib=_LIB)
        self._backward_fn, self._setup_context_fn = backward, setup_context


_PLAIN = (int, float, bool, str, type(None), list, tuple)
_Tensor = torch.Tensor
_STRIDED = torch.strided


def _direct_ok(args, kwargs) -> bool:
    """True when a call through the dispatcher would only run the op's body (L104): no
    torch.compile / jit tracing, no dispatch or torch-function mode, no functorch transform, no
    profiler (which records the op by name), every tensor a plain, strided, non-meta
    torch.Tensor that needs no gradient (or grad mode off), every other argument a plain
    Python value. The dispatcher's
    own work for such a call (boxing the arguments twice, the autograd kernel's redispatch) is
    about 5-8 us, as much as the whole op at T=16."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None
            or torch.autograd._profiler_enabled() or torch.jit.is_tracing()):
        return False
    grad = torch.is_grad_enabled()
    for a in (*args, *kwargs.values()):
        if type(a) is _Tensor:
            # meta tensors go to the fake kernel (its device error); nested and sparse ones to
            # the dispatcher's missing-kernel error
            if (grad and a.requires_grad) or a.is_meta or a.layout is not _STRIDED:
                return False
        elif not isinstance(a, _PLAIN):
            return False
    return True


def _op(qualname: str):
    """Decorator: registers the function as the operator `qualname` ("moegrad::<name>")."""
    ns, name = qualname.split("::")
    assert ns == "moegrad", qualname
    return lambda fn: _Op(name, fn)


def _needs(ctx, n: int) -> Tuple[bool, ...]:
    """needs_input_grad padded to the schema's n inputs (torch drops trailing defaults)."""
    got = tuple(ctx.needs_input_grad)
    return got + (False,) * (n - len(got))


def _args(inputs, defaults):
    """The op's inputs with the trailing defaults torch dropped filled back in."""
    return tuple(inputs) + tuple(defaults[len(inputs):])


# ---- CUDA backend: stream and workspace of the one-shot _C.<op>(..., outputs) calls ----
def _cuda_launch_context(device: int, workspace_bytes: int):
    """Called by the native module for one-shot calls on CUDA tensors: torch's current stream
    of `device` and a workspace from torch's caching allocator (None when none is needed)."""
    stream = torch.cuda.current_stream(device).cuda_stream
    ws = (torch.empty(workspace_bytes, dtype=torch.uint8, device=torch.device("cuda", device))
          if workspace_bytes else None)
    return stream, ws


_C._set_cuda_hook(_cuda_launch_context)
# ---- end CUDA launch context ----


# ---------------------------------------------------------------------------------------------
# Gating top-k (§1, §2)
# ---------------------------------------------------------------------------------------------
@_op("moegrad::moe_gating_top_k")
def moe_gating_top_k(x: Tensor, k: int, bias: Optional[Tensor] = None, k_group: int = 1,
                     group_count: int = 1, group_select_mode: int = 0, renorm: int = 0,
                     norm_type: int = 0, out_flag: bool = False,
                     routed_scaling_factor: float = 1.0,
                     eps: float = 1e-20) -> Tuple[Tensor, Tensor, Tensor]:
    x, bias = x.contiguous(), _contig(bias)
    attrs = (k, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
             routed_scaling_factor, eps)
    y, idx, norm = _execute(_C.plan_moe_gating_top_k(_dl(x), _dlo(bias), *attrs), x)
    return y, idx, norm


@moe_gating_top_k.register_fake
def _(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
      out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    _same_device("moe_gating_top_k", ("x", x), ("bias", bias))
    m, n = x.shape[0], x.shape[1]
    return (x.new_empty((m, k)), x.new_empty((m, k), dtype=torch.int32),
            x.new_empty((m, n), dtype=torch.float32))


@_op("moegrad::moe_gating_top_k_backward")
def moe_gating_top_k_backward(x_norm: Tensor, grad_y: Tensor, expert_idx: Tensor,
                              renorm: int = 0, norm_type: int = 1,
                              routed_scaling_factor: float = 1.0, eps: float = 1e-20) -> Tensor:
    x_norm, grad_y, expert_idx = x_norm.contiguous(), grad_y.contiguous(), expert_idx.contiguous()
    attrs = (renorm, norm_type, routed_scaling_factor, eps)
    planned = _C.plan_moe_gating_top_k_backward(_dl(x_norm), _dl(grad_y), _dl(expert_idx), *attrs)
    (grad_x,) = _execute(planned, grad_y)
    return grad_x


@moe_gating_top_k_backward.register_fake
def _(x_norm, grad_y, expert_idx, renorm=0, norm_type=1, routed_scaling_factor=1.0, eps=1e-20):
    _same_device("moe_gating_top_k_backward", ("x_norm", x_norm), ("grad_y", grad_y),
                 ("expert_idx", expert_idx))
    return grad_y.new_empty(x_norm.shape)


def _gating_setup(ctx, inputs, output):
    x, _k, _bias, _kg, _gc, _gsm, renorm, norm_type, out_flag, rsf, eps = _args(
        inputs, (None, None, None, 1, 1, 0, 0, 0, False, 1.0, 1e-20))
    _y, idx, norm = output
    ctx.save_for_backward(x, idx, norm)
    ctx.attrs = (renorm, norm_type, out_flag, rsf, eps)


def _normalise(x: Tensor, norm_type: int) -> Tensor:
    """The forward's normalised scores in fp32 (norm_out without bias), §2.4 step 1."""
    x = x.float()
    if norm_type == 0:
        return torch.softmax(x, dim=-1)
    if norm_type == 1:
        return torch.sigmoid(x)
    return torch.sqrt(torch.nn.functional.softplus(x))


def _normalise_backward(grad: Tensor, s: Tensor, norm_type: int) -> Tensor:
    """Vector-Jacobian product of the normalisation at scores s (fp32), for the norm_out path."""
    if norm_type == 0:
        return s * (grad - (s * grad).sum(dim=-1, keepdim=True))
    if norm_type == 1:
        return grad * s * (1.0 - s)
    dn = torch.where(s > 0, -torch.expm1(-s * s) / (2.0 * s), torch.zeros_like(s))
    return grad * dn


def _gating_backward(ctx, grad_y, _grad_idx, grad_norm):
    # Every norm type (D22, L21): the native backward takes the forward's normalised scores.
    renorm, norm_type, out_flag, rsf, eps = ctx.attrs
    x, idx, norm = ctx.saved_tensors
    x_norm = norm if out_flag else _normalise(x, norm_type)
    # With a norm_out gradient both terms are summed in fp32 and rounded once (D12).
    two_terms = out_flag and grad_norm is not None
    grad_x = moe_gating_top_k_backward(x_norm, grad_y.float() if two_terms else grad_y, idx,
                                       renorm, norm_type, rsf, eps)
    if two_terms:
        grad_x = (grad_x + _normalise_backward(grad_norm.float(), x_norm, norm_type)).to(x.dtype)
    return (grad_x,) + (None,) * 10


moe_gating_top_k.register_autograd(_gating_backward, setup_context=_gating_setup)


# ---------------------------------------------------------------------------------------------
# Finalize routing (§3, §4, §7.3)
# ---------------------------------------------------------------------------------------------
@_op("moegrad::moe_finalize_routing")
def moe_finalize_routing(expanded_x: Tensor, expanded_row_idx: Tensor,
                         x1: Optional[Tensor] = None, x2: Optional[Tensor] = None,
                         bias: Optional[Tensor] = None, scales: Optional[Tensor] = None,
                         expert_idx: Optional[Tensor] = None, drop_pad_mode: int = 0,
                         k: int = 1) -> Tensor:
    expanded_x, idx = expanded_x.contiguous(), expanded_row_idx.contiguous()
    eidx = _contig(expert_idx)
    x1, x2, bias, scales = _contig(x1), _contig(x2), _contig(bias), _contig(scales)
    planned = _C.plan_moe_finalize_routing(_dl(expanded_x), _dl(idx), _dlo(x1), _dlo(x2),
                                           _dlo(bias), _dlo(scales), _dlo(eidx), drop_pad_mode, k)
    (out,) = _execute(planned, expanded_x)
    return out


@moe_finalize_routing.register_fake
def _(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None, expert_idx=None,
      drop_pad_mode=0, k=1):
    _same_device("moe_finalize_routing", ("expanded_x", expanded_x),
                 ("expanded_row_idx", expanded_row_idx), ("x1", x1), ("x2", x2), ("bias", bias),
                 ("scales", scales), ("expert_idx", expert_idx))
    if scales is not None:
        rows = scales.shape[0]
    elif expert_idx is not None:
        rows = expert_idx.shape[0]
    elif x1 is not None:
        rows = x1.shape[0]
    else:
        rows = expanded_row_idx.shape[0] // k
    hidden = expanded_x.shape[-1]
    return expanded_x.new_empty((rows, hidden))


@_op("moegrad::moe_finalize_routing_grad")
def moe_finalize_routing_grad(grad_y: Tensor, expanded_row_idx: Tensor,
                              expanded_x: Optional[Tensor] = None,
                              scales: Optional[Tensor] = None,
                              expert_idx: Optional[Tensor] = None,
                              bias: Optional[Tensor] = None, drop_pad_mode: int = 0,
                              active_num: int = 0, expert_num: int = 0,
                              expert_capacity: int = 0) -> Tuple[Tensor, Tensor]:
    grad_y, idx, eidx = grad_y.contiguous(), expanded_row_idx.contiguous(), _contig(expert_idx)
    expanded_x, scales, bias = _contig(expanded_x), _contig(scales), _contig(bias)
    attrs = (drop_pad_mode, active_num, expert_num, expert_capacity)
    planned = _C.plan_moe_finalize_routing_grad(_dl(grad_y), _dl(idx), _dlo(expanded_x),
                                                _dlo(scales), _dlo(eidx), _dlo(bias), *attrs)
    gex, gs = _execute(planned, grad_y)
    return gex, gs


@moe_finalize_routing_grad.register_fake
def _(grad_y, expanded_row_idx, expanded_x=None, scales=None, expert_idx=None, bias=None,
      drop_pad_mode=0, active_num=0, expert_num=0, expert_capacity=0):
    _same_device("moe_finalize_routing_grad", ("grad_y", grad_y),
                 ("expanded_row_idx", expanded_row_idx), ("expanded_x", expanded_x),
                 ("scales", scales), ("expert_idx", expert_idx), ("bias", bias))
    r, h = grad_y.shape[0], grad_y.shape[1]
    n = expanded_row_idx.shape[0]
    if drop_pad_mode == 1:
        gex = grad_y.new_empty((expert_num, expert_capacity, h))
    else:
        rows = active_num if 0 < active_num < n else n
        gex = grad_y.new_empty((rows, h))
    if scales is not None:
        gs = scales.new_empty((r, scales.shape[1]))
    else:
        gs = grad_y.new_empty((r, 1))
    return gex, gs


def _present(t: Optional[Tensor]) -> bool:
    return t is not None and t.numel() > 0


def _finalize_setup(ctx, inputs, output):
    expanded_x, idx, x1, x2, bias, scales, expert_idx, drop_pad_mode, k = _args(
        inputs, (None,) * 7 + (0, 1))
    ctx.mode = 0 if drop_pad_mode is None else drop_pad_mode
    # The forward's own K (L4: scales, expert_idx, or len(idx) / R), so backward always agrees.
    rows = output.shape[0]
    ctx.k = idx.shape[0] // rows if rows > 0 else (1 if k is None else k)
    ctx.has_scales = _present(scales)
    ctx.has_bias = _present(bias)
    # Optional inputs given with 0 elements count as absent, but one that requires grad still
    # gets a (zero-element) gradient of its own shape, as autograd of the formula gives it.
    ctx.empty = {i: (t.shape, t.dtype, t.device) for i, t in ((4, bias), (5, scales))
                 if t is not None and t.numel() == 0}
    ctx.save_for_backward(expanded_x, idx, scales if ctx.has_scales else None,
                          bias if ctx.has_bias else None, expert_idx)


@_op("moegrad::moe_finalize_routing_bias_grad")
def moe_finalize_routing_bias_grad(grad_y: Tensor, expert_idx: Tensor,
                                   scales: Optional[Tensor], expert_num: int) -> Tensor:
    """Gradient of finalize routing's bias (D23, L22): per expert, the sum of scale * grad_y
    over the slots using it, dropped slots included. Internal op of the autograd."""
    if grad_y.is_cuda:
        # ---- CUDA backend: no CUDA kernel for this op yet; computed on the CPU (synchronises,
        # not capturable in a CUDA graph; docs/cuda.md) ----
        to_cpu = (lambda t: None if t is None else t.cpu())  # noqa: E731
        return moe_finalize_routing_bias_grad(grad_y.cpu(), to_cpu(expert_idx), to_cpu(scales),
                                              expert_num).to(grad_y.device)
    grad_y, eidx, scales = grad_y.contiguous(), expert_idx.contiguous(), _contig(scales)
    planned = _C.plan_moe_finalize_routing_bias_grad(_dl(grad_y), _dl(eidx), _dlo(scales),
                                                     expert_num)
    (grad_bias,) = _execute(planned, grad_y)
    return grad_bias


@moe_finalize_routing_bias_grad.register_fake
def _(grad_y, expert_idx, scales, expert_num):
    _same_device("moe_finalize_routing_bias_grad", ("grad_y", grad_y),
                 ("expert_idx", expert_idx), ("scales", scales))
    return grad_y.new_empty((expert_num, grad_y.shape[1]))


def _finalize_backward(ctx, grad_out):
    # Every differentiable input gets its gradient (D23): x1 and x2 receive grad_y, bias the
    # per-expert sum, expanded_x and scales the V2Grad op's outputs; modes 2/3 too.
    needs = _needs(ctx, 9)
    grads = [None] * 9
    for i, (shape, dtype, device) in ctx.empty.items():
        if needs[i]:
            grads[i] = torch.zeros(shape, dtype=dtype, device=device)
    expanded_x, idx, scales, bias, expert_idx = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    if needs[2]:
        grads[2] = grad_out
    if needs[3]:
        grads[3] = grad_out
    if needs[4] and ctx.has_bias:
        grads[4] = moe_finalize_routing_bias_grad(grad_out, expert_idx, scales,
                                                  bias.shape[0]).to(bias.dtype)
    want_x, want_s = needs[0], ctx.has_scales and needs[5]
    if not (want_x or want_s):
        return tuple(grads)
    rows = grad_out.shape[0]
    top_k = scales.shape[1] if ctx.has_scales else ctx.k
    # Column layout (k*R + r) of modes 0/1 to the row layout (r*K + k) of the grad op; modes
    # 2/3 are already in row layout.
    if top_k > 1 and ctx.mode in (0, 1):
        idx = idx.reshape(top_k, rows).t().contiguous().reshape(-1)
    if not ctx.has_scales and top_k > 1:
        scales = torch.ones((rows, top_k), dtype=grad_out.dtype, device=grad_out.device)
    grad_mode = ctx.mode % 2  # 0/2 dropless, 1/3 drop-pad
    if grad_mode == 1:
        active_num, expert_num, capacity = 0, expanded_x.shape[0], expanded_x.shape[1]
    else:
        active_num, expert_num, capacity = expanded_x.shape[0], 0, 0
    gex, gs = moe_finalize_routing_grad(grad_out, idx, expanded_x, scales, expert_idx,
                                        bias if scales is not None else None, grad_mode,
                                        active_num, expert_num, capacity)
    grads[0] = gex if want_x else None
    if want_s:
        grads[5] = gs
    return tuple(grads)


moe_finalize_routing.register_autograd(_finalize_backward, setup_context=_finalize_setup)


# ---------------------------------------------------------------------------------------------
# SwiGLU (§5, §6.4)
# ---------------------------------------------------------------------------------------------
@_op("moegrad::swiglu_group")
def swiglu_group(x: Tensor, weight: Optional[Tensor] = None,
                 group_index: Optional[Tensor] = None, clamp_limit: float = -1.0) -> Tensor:
    x, weight, group_index = x.contiguous(), _contig(weight), _contig(group_index)
    planned = _C.plan_swiglu_group(_dl(x), _dlo(weight), _dlo(group_index), clamp_limit)
    (y,) = _execute(planned, x)
    return y


@swiglu_group.register_fake
def _(x, weight=None, group_index=None, clamp_limit=-1.0):
    _same_device("swiglu_group", ("x", x), ("weight", weight), ("group_index", group_index))
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@_op("moegrad::swiglu_group_quant_backward")
def swiglu_group_quant_backward(grad_y: Tensor, x: Tensor, weight: Optional[Tensor] = None,
                                y_origin: Optional[Tensor] = None,
                                group_index: Optional[Tensor] = None,
                                clamp_limit: float = -1.0) -> Tuple[Tensor, Tensor]:
    grad_y, x = grad_y.contiguous(), x.contiguous()
    weight, y_origin, group_index = _contig(weight), _contig(y_origin), _contig(group_index)
    planned = _C.plan_swiglu_group_quant_backward(_dl(grad_y), _dl(x), _dlo(weight),
                                                  _dlo(y_origin), _dlo(group_index), clamp_limit)
    grad_x, grad_w = _execute(planned, x)
    return grad_x, grad_w


@swiglu_group_quant_backward.register_fake
def _(grad_y, x, weight=None, y_origin=None, group_index=None, clamp_limit=-1.0):
    _same_device("swiglu_group_quant_backward", ("x", x), ("grad_y", grad_y), ("weight", weight),
                 ("y_origin", y_origin), ("group_index", group_index))
    gw_shape = weight.shape if weight is not None else (0,)
    return x.new_empty(x.shape), x.new_empty(gw_shape, dtype=torch.float32)


def _swiglu_setup(ctx, inputs, output):
    x, weight, group_index, clamp_limit = _args(inputs, (None, None, None, -1.0))
    ctx.clamp_limit = clamp_limit
    ctx.save_for_backward(x, weight, group_index)


def _swiglu_backward(ctx, grad_y):
    x, weight, group_index = ctx.saved_tensors
    needs = _needs(ctx, 4)
    y_origin = None
    if weight is not None:
        if needs[1]:
            # The backward needs the UNWEIGHTED activation (D10): recompute it.
            y_origin = swiglu_group(x, None, group_index, ctx.clamp_limit)
        else:
            # grad_weight is discarded; any tensor of grad_y's shape satisfies the contract.
            y_origin = grad_y
    grad_x, grad_w = swiglu_group_quant_backward(grad_y, x, weight, y_origin, group_index,
                                                 ctx.clamp_limit)
    want_w = weight is not None and needs[1]
    return grad_x, (grad_w.to(weight.dtype) if want_w else None), None, None


swiglu_group.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# ---------------------------------------------------------------------------------------------
# SwiGLU quantised forward (§6, D10, D24; docs/decisions.md L24-L28)
# ---------------------------------------------------------------------------------------------
# dst_type: the vendor's Python codes (torch_npu 291/292/290/296/297 and torch ScalarType 23/24)
# mapped to the aclDataType codes of the native call. Unknown values are passed through, so the
# native error names them.
_DST_CODES = {291: 35, 23: 35, 292: 36, 24: 36, 290: 34, 296: 40, 297: 41}
_FP8_DTYPES = {35: torch.float8_e5m2, 36: torch.float8_e4m3fn}


def _quant_shapes(x, quant_mode):
    lead, h = list(x.shape[:-1]), x.shape[-1] // 2
    if quant_mode == 1:
        nb = (h + 31) // 32
        return lead + [h], lead + [(nb + 1) // 2, 2]
    return lead + [h], lead + [(h + 127) // 128]


@_op("moegrad::swiglu_group_quant")
def swiglu_group_quant(x: Tensor, weight: Optional[Tensor] = None,
                       group_index: Optional[Tensor] = None, scale: Optional[Tensor] = None,
                       dst_type: int = 292, quant_mode: int = 0, block_size: int = 0,
                       round_scale: bool = False, clamp_limit: float = -1.0,
                       dst_type_max: float = 15.0,
                       output_origin: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    x, weight, group_index, scale = (x.contiguous(), _contig(weight), _contig(group_index),
                                     _contig(scale))
    code = _DST_CODES.get(dst_type, dst_type)
    y, y_scale, y_origin = _execute(_C.plan_swiglu_group_quant(
        x, weight, group_index, scale, code, quant_mode, block_size, round_scale, clamp_limit,
        dst_type_max, output_origin), x)
    return y, y_scale, y_origin


@swiglu_group_quant.register_fake
def _(x, weight=None, group_index=None, scale=None, dst_type=292, quant_mode=0, block_size=0,
      round_scale=False, clamp_limit=-1.0, dst_type_max=15.0, output_origin=False):
    _same_device("swiglu_group_quant", ("x", x), ("weight", weight),
                 ("group_index", group_index), ("scale", scale))
    code = _DST_CODES.get(dst_type, dst_type)
    sy, ss = _quant_shapes(x, quant_mode)
    y = x.new_empty(sy, dtype=_FP8_DTYPES.get(code, torch.uint8))
    s = x.new_empty(ss, dtype=torch.float32 if quant_mode == 0 else torch.float8_e8m0fnu)
    o = x.new_empty(sy if output_origin else [0])
    return y, s, o


def _swiglu_quant_setup(ctx, inputs, output):
    x, weight, group_index, _scale, _dst, _qm, _bs, _rs, clamp_limit, _dtm, output_origin = (
        _args(inputs, (None, None, None, None, 292, 0, 0, False, -1.0, 15.0, False)))
    y, y_scale, _ = output
    ctx.mark_non_differentiable(y, y_scale)
    ctx.clamp_limit = clamp_limit
    ctx.output_origin = output_origin
    ctx.save_for_backward(x, weight, group_index)


def _swiglu_quant_backward(ctx, _grad_y, _grad_scale, grad_origin):
    # Only y_origin (the weighted SwiGLU) carries gradient (§6.6); the backward needs the
    # unweighted activation (D10), recomputed only when the weight's gradient is wanted.
    nones = [None] * 11
    if not ctx.output_origin or grad_origin is None:
        return tuple(nones)
    x, weight, group_index = ctx.saved_tensors
    needs = _needs(ctx, 11)
    y_origin = None
    if weight is not None:
        y_origin = (swiglu_group(x, None, group_index, ctx.clamp_limit) if needs[1]
                    else grad_origin)
    grad_x, grad_w = swiglu_group_quant_backward(grad_origin, x, weight, y_origin, group_index,
                                                 ctx.clamp_limit)
    nones[0] = grad_x if needs[0] else None
    nones[1] = grad_w.to(weight.dtype) if (weight is not None and needs[1]) else None
    return tuple(nones)


swiglu_group_quant.register_autograd(_swiglu_quant_backward, setup_context=_swiglu_quant_setup)


# ---------------------------------------------------------------------------------------------
# Init routing = token permutation (docs/operators.md §8; D25-D31; L30-L39)
# ---------------------------------------------------------------------------------------------
def _init_routing_attrs(expert_num, active_expert_range, expert_tokens_num_flag):
    """(has_range, start, end, flag): counts need E; without E and window they are off (L33)."""
    if active_expert_range is not None and len(active_expert_range) > 0:
        if len(active_expert_range) != 2:
            raise MoeError("moe_init_routing: active_expert_range: must hold 2 values [start, "
                           f"end); got {list(active_expert_range)}", ERR_FINALIZE_ROUTING)
        start, end = int(active_expert_range[0]), int(active_expert_range[1])
        return True, start, end, bool(expert_tokens_num_flag)
    flag = bool(expert_tokens_num_flag) and expert_num > 0
    return False, 0, 0, flag


@_op("moegrad::moe_init_routing")
def moe_init_routing(x: Tensor, expert_idx: Tensor, active_num: int = 0,
                     expert_capacity: int = 0, expert_num: int = 0, drop_pad_mode: int = 0,
                     expert_tokens_num_type: int = 1, expert_tokens_num_flag: bool = True,
                     active_expert_range: Optional[List[int]] = None,
                     row_idx_type: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    if x.is_cuda:
        # ---- CUDA backend: no CUDA kernel for this op yet; computed on the CPU (synchronises,
        # not capturable in a CUDA graph; docs/cuda.md) ----
        outs = moe_init_routing(x.cpu(), expert_idx.cpu(), active_num, expert_capacity,
                                expert_num, drop_pad_mode, expert_tokens_num_type,
                                expert_tokens_num_flag, active_expert_range, row_idx_type)
        return tuple(t.to(x.device) for t in outs)
    x, eidx = x.contiguous(), expert_idx.contiguous()
    has_range, start, end, flag = _init_routing_attrs(expert_num, active_expert_range,
                                                      expert_tokens_num_flag)
    attrs = (active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_num_type,
             flag, has_range, start, end, row_idx_type)
    ex, idx, tokens = _execute(_C.plan_moe_init_routing(_dl(x), _dl(eidx), *attrs), x)
    return ex, idx, tokens


@moe_init_routing.register_fake
def _(x, expert_idx, active_num=0, expert_capacity=0, expert_num=0, drop_pad_mode=0,
      expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=None,
      row_idx_type=0):
    _same_device("moe_init_routing", ("x", x), ("expert_idx", expert_idx))
    r, h = x.shape[0], x.shape[1]
    n = r * expert_idx.shape[1]
    if drop_pad_mode == 1:
        ex = x.new_empty((expert_num, expert_capacity, h))
    else:
        ex = x.new_empty((min(active_num, n) if active_num > 0 else n, h))
    has_range, start, end, flag = _init_routing_attrs(expert_num, active_expert_range,
                                                      expert_tokens_num_flag)
    if not flag:
        tshape = (0,)
    elif expert_tokens_num_type == 2:
        tshape = (expert_num, 2)
    else:
        tshape = ((end - start) if has_range else expert_num,)
    return ex, x.new_empty((n,), dtype=torch.int32), x.new_empty(tshape, dtype=torch.int64)


@_op("moegrad::moe_init_routing_grad")
def moe_init_routing_grad(grad_expanded_x: Tensor, expanded_row_idx: Tensor, top_k: int,
                          drop_pad_mode: int = 0, active_num: int = 0) -> Tensor:
    if grad_expanded_x.is_cuda:
        # ---- CUDA backend: no CUDA kernel yet; computed on the CPU (docs/cuda.md) ----
        return moe_init_routing_grad(grad_expanded_x.cpu(), expanded_row_idx.cpu(), top_k,
                                     drop_pad_mode, active_num).to(grad_expanded_x.device)
    g, idx = grad_expanded_x.contiguous(), expanded_row_idx.contiguous()
    (gx,) = _execute(
        _C.plan_moe_init_routing_grad(_dl(g), _dl(idx), top_k, drop_pad_mode, active_num), g)
    return gx


@moe_init_routing_grad.register_fake
def _(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=0, active_num=0):
    _same_device("moe_init_routing_grad", ("grad_expanded_x", grad_expanded_x),
                 ("expanded_row_idx", expanded_row_idx))
    return grad_expanded_x.new_empty((expanded_row_idx.shape[0] // top_k,
                                      grad_expanded_x.shape[-1]))


def _init_routing_setup(ctx, inputs, output):
    (x, expert_idx, active_num, _cap, _e, drop_pad_mode, _tt, _tf, _rng,
     row_idx_type) = _args(inputs, (None, None, 0, 0, 0, 0, 1, True, None, 0))
    _ex, idx, _tok = output
    ctx.k = expert_idx.shape[1]
    ctx.mode = drop_pad_mode
    ctx.active_num = max(int(active_num), 0)
    ctx.row_idx_type = row_idx_type
    ctx.save_for_backward(idx)


def _init_routing_backward(ctx, grad_ex, _grad_idx, _grad_tok):
    if ctx.row_idx_type != 0:
        raise NotImplementedError(
            "moegrad.moe_init_routing: backward needs row_idx_type=0 (the src->dst index); "
            f"got row_idx_type={ctx.row_idx_type} (decisions.md D25)")
    (idx,) = ctx.saved_tensors
    gx = moe_init_routing_grad(grad_ex, idx, ctx.k, ctx.mode,
                               ctx.active_num if ctx.mode == 0 else 0)
    return (gx,) + (None,) * 9


moe_init_routing.register_autograd(_init_routing_backward, setup_context=_init_routing_setup)
