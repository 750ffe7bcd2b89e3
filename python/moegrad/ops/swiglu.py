"""SwiGLU: swiglu_group, its backward and the quantised forward (docs/operators.md §5, §6, §6.4).

Registration, fake kernels and autograd of swiglu_group, swiglu_group_quant_backward and
swiglu_group_quant (registered with an int dst_type; the public function also takes a torch
float8 dtype); the C++ side is src/ops/swiglu/.
"""
from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _C
from .._errors import MoeError
from ._registry import _args, _contig, _dl, _dlo, _execute, _needs, _op, _same_device


@_op("moegrad::swiglu_group")
def swiglu_group(x: Tensor, weight: Optional[Tensor] = None,
                 group_index: Optional[Tensor] = None, clamp_limit: float = -1.0) -> Tensor:
    """SwiGLU with per-token weight, clamp and MoE group truncation (§6.4, D9, D11, L8).

    x: [..., 2H] float32/float16/bfloat16, split into gate x0 and up x1. With clamp_limit c > 0:
    x0 <- min(x0, c), x1 <- clamp(x1, -c, c). y = silu(x0) * x1 * weight[t] for token rows
    t < sum(group_index) (all rows without group_index), 0 after. weight: float32 with T
    elements (T = product of leading dims; [T], [T, 1], [B, S] ...). Returns [..., H] x.dtype.
    Differentiable w.r.t. x and weight. Errors: MoeError 161001/161002, 561002.
    """
    x, weight, group_index = x.contiguous(), _contig(weight), _contig(group_index)
    planned = _C.plan_swiglu_group(_dl(x), _dlo(weight), _dlo(group_index), clamp_limit)
    (y,) = _execute(planned, x)
    return y


@swiglu_group.register_fake
def _(x, weight=None, group_index=None, clamp_limit=-1.0):
    _same_device("swiglu_group", ("x", x), ("weight", weight), ("group_index", group_index))
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@_op("moegrad::swiglu_group_quant_backward", no_double_backward=(
    "the second derivative of SwiGLU (w.r.t. x) is not implemented; for second-order "
    "gradients differentiate a PyTorch formula of swiglu_group"))
def swiglu_group_quant_backward(grad_y: Tensor, x: Tensor, weight: Optional[Tensor] = None,
                                y_origin: Optional[Tensor] = None,
                                group_index: Optional[Tensor] = None,
                                clamp_limit: float = -1.0) -> Tuple[Tensor, Tensor]:
    """Gradients of swiglu_group (SwigluGroupQuantGrad, §5, D10, D11).

    grad_y: [..., H]; x: [..., 2H] (same dtype); weight: float32, T elements (needs y_origin,
    the UNWEIGHTED activation silu(x0')*x1'); group_index: [G] int64. Returns (grad_x like x,
    grad_weight float32 shaped like weight = sum_h grad_y * y_origin, or an empty [0] float32
    tensor without weight). Rows past sum(group_index) are zero. Errors: MoeError 161001/
    161002, 561002.
    """
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


def _swiglu_group_backward_over_x(grad_y: Tensor, x: Tensor, group_index: Optional[Tensor],
                                  clamp_limit: float = -1.0) -> Tensor:
    """swiglu_group_quant_backward's grad_x (no weight; docs/operators.md §5) written over x
    itself when x is a contiguous CPU tensor (each row's gate and up are read before their
    gradient is stored over them; docs/decisions.md L228), else into a new tensor.
    grad_y [..., H] and x [..., 2H] float32/float16/bfloat16 (one dtype); group_index [G] int64
    or None. Returns the gradient, [..., 2H] in x's dtype. Not an operator:
    autograd does not see the write, so x must be a tensor that nothing else reads afterwards
    (the up-GEMM output of moegrad.nn.MoE and moegrad.hf). Same validation and errors as swiglu_group_quant_backward."""
    if x.device.type != "cpu" or not x.is_contiguous():
        return swiglu_group_quant_backward(grad_y, x, None, None, group_index, clamp_limit)[0]
    _C.swiglu_group_quant_backward(grad_y.contiguous(), x, None, None, _contig(group_index),
                                   clamp_limit, x, None)
    return x


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
# Quantised forward (§6, D10, D24; docs/decisions.md L24-L28)
# ---------------------------------------------------------------------------------------------
# dst_type: the vendor's Python codes (torch_npu 291/292/290/296/297 and torch ScalarType 23/24)
# reach the native plan as given; it translates them to aclDataType, validates and names the
# code given in its errors (L153). The fake kernel needs the output dtype of the FP8 codes.
_DST_CODES = {291: 35, 23: 35, 292: 36, 24: 36}
_FP8_DTYPES = {35: torch.float8_e5m2, 36: torch.float8_e4m3fn}


def _quant_shapes(x, quant_mode):
    lead, h = list(x.shape[:-1]), x.shape[-1] // 2
    if quant_mode == 1:
        nb = (h + 31) // 32
        return lead + [h], lead + [(nb + 1) // 2, 2]
    return lead + [h], lead + [(h + 127) // 128]


@_op("moegrad::swiglu_group_quant")
def _swiglu_group_quant(x: Tensor, weight: Optional[Tensor] = None,
                        group_index: Optional[Tensor] = None, scale: Optional[Tensor] = None,
                        dst_type: int = 292, quant_mode: int = 0, block_size: int = 0,
                        round_scale: bool = False, clamp_limit: float = -1.0,
                        dst_type_max: float = 15.0,
                        output_origin: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """The registered schema of swiglu_group_quant (torch.ops.moegrad.swiglu_group_quant):
    dst_type is an int code (vendor or aclDataType). Public function: swiglu_group_quant.
    """
    x, weight, group_index, scale = (x.contiguous(), _contig(weight), _contig(group_index),
                                     _contig(scale))
    y, y_scale, y_origin = _execute(_C.plan_swiglu_group_quant(
        x, weight, group_index, scale, dst_type, quant_mode, block_size, round_scale, clamp_limit,
        dst_type_max, output_origin), x)
    return y, y_scale, y_origin


@_swiglu_group_quant.register_fake
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


_swiglu_group_quant.register_autograd(_swiglu_quant_backward, setup_context=_swiglu_quant_setup)


_DST_TYPES = {torch.float8_e4m3fn: 292, torch.float8_e5m2: 291}


def swiglu_group_quant(x: Tensor, weight: Optional[Tensor] = None,
                       group_index: Optional[Tensor] = None, scale: Optional[Tensor] = None, *,
                       dst_type=torch.float8_e4m3fn, quant_mode: int = 0, block_size: int = 0,
                       round_scale: bool = False, clamp_limit: float = -1.0,
                       dst_type_max: float = 15.0,
                       output_origin: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """SwiGLU with per-token weight and FP8 / MX quantisation (SwigluGroupQuant, §6, D24).

    y_w = silu(x0') * x1' * weight[t] (clamp as swiglu_group), rows >= sum(group_index) zero.
    Quantised per block of H: quant_mode 0, 128 wide, y_scale float32 [..., ceil(H/128)] =
    max(amax, 1e-4) / fp8max (rounded up to a power of two with round_scale); quant_mode 1 (MX,
    round_scale=True), 32 wide, y_scale float8_e8m0fnu [..., ceil(ceil(H/32)/2), 2]. y = the
    FP8 code of y_w / scale (round to nearest even), so y.float() * scale dequantises.
    dst_type: torch.float8_e4m3fn / torch.float8_e5m2 or the vendor codes 292/24, 291/23.
    y_origin: y_w in x's dtype with output_origin, else an empty [0] tensor; the only output
    that carries gradient (to x and weight). scale must be None (HiFloat8 only). HiFloat8
    (quant_mode 2/3, dst 290) and FP4 fail with 161002. Errors: MoeError 161001/161002/561002.
    """
    if isinstance(dst_type, torch.dtype):
        if dst_type not in _DST_TYPES:
            raise MoeError(f"swiglu_group_quant: dst_type: must be torch.float8_e4m3fn or "
                           f"torch.float8_e5m2; got {dst_type}", 161002)
        dst_type = _DST_TYPES[dst_type]
    try:  # the code as given: int() would report 290.5 as 290 (L153)
        dst_type = operator.index(dst_type)
    except TypeError:
        raise MoeError("swiglu_group_quant: dst_type: must be a torch float8 dtype or an int "
                       f"code; got {dst_type!r}", 161002) from None
    return _swiglu_group_quant(x, weight, group_index, scale, dst_type, quant_mode,
                               block_size, round_scale, clamp_limit, dst_type_max, output_origin)
