"""ClippedSwiglu: the GPT-OSS SwiGLU and its backward (docs/operators.md §9, decisions D32,
L160-L165).

Registration, fake kernels and autograd of clipped_swiglu and clipped_swiglu_grad; the C++ side
is src/ops/clipped_swiglu/.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .. import _C
from .._errors import ERR_PARAM_INVALID, MoeError
from ._registry import _contig, _dl, _dlo, _execute, _op, _same_device


@_op("moegrad::clipped_swiglu")
def clipped_swiglu(x: Tensor, group_index: Optional[Tensor] = None, *, dim: int = -1,
                   alpha: float = 1.702, limit: float = 7.0, bias: float = 1.0,
                   interleaved: bool = True, clamp_mode: int = 0) -> Tensor:
    """The GPT-OSS SwiGLU (ClippedSwiglu V1/V2, docs/operators.md §9.4).

    x: float32/float16/bfloat16, rank 1..8, x.shape[dim] even. x is viewed as [pre, 2h] around
    dim (pre = product of the dims before dim); the gate A and linear half B are the even and odd
    elements of each folded row (interleaved, the GPT-OSS weight layout) or its first and second
    halves. clamp_mode 0: A' = min(A, limit), B' = clamp(B, -limit, limit),
    y = A' * sigmoid(alpha * A') * (B' + bias). clamp_mode 1: y = min(A * sigmoid(A), limit) * B'
    (alpha and bias must keep their defaults). Rows p >= sum(group_index) ([G] int64) are +0.
    Returns x's shape with shape[dim] halved, x.dtype; differentiable w.r.t. x in both modes.
    Errors: MoeError 161001/161002 (dtype, rank, dim, clamp_mode), 561002 (shapes, limit <= 0 or
    not finite, alpha/bias not finite).
    """
    x, group_index = x.contiguous(), _contig(group_index)
    planned = _C.plan_clipped_swiglu(_dl(x), _dlo(group_index), dim, alpha, limit, bias,
                                     interleaved, clamp_mode)
    (y,) = _execute(planned, x)
    return y


def _halved(op: str, x: Tensor, dim: int):
    r = x.dim()
    if not 1 <= r <= 8 or not -r <= dim < r:
        # the native plan's rules (161002); only the shape arithmetic needs them here
        raise MoeError(f"{op}: dim: must be in [{-r}, {r - 1}] for x of rank {r} (rank 1..8); "
                       f"got {dim}", ERR_PARAM_INVALID)
    shape = list(x.shape)
    shape[dim] //= 2
    return shape


@clipped_swiglu.register_fake
def _(x, group_index=None, *, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True,
      clamp_mode=0):
    _same_device("clipped_swiglu", ("x", x), ("group_index", group_index))
    return x.new_empty(_halved("clipped_swiglu", x, dim))


@_op("moegrad::clipped_swiglu_grad", no_double_backward=(
    "the second derivative of the clipped SwiGLU (w.r.t. x) is not implemented; for "
    "second-order gradients differentiate a PyTorch formula of clipped_swiglu"))
def clipped_swiglu_grad(grad_y: Tensor, x: Tensor, group_index: Optional[Tensor] = None, *,
                        dim: int = -1, alpha: float = 1.702, limit: float = 7.0,
                        bias: float = 1.0, interleaved: bool = True,
                        clamp_mode: int = 0) -> Tensor:
    """Gradient of clipped_swiglu w.r.t. x (ClippedSwigluGrad, docs/operators.md §9.5; clamp_mode
    1: docs/decisions.md L163).

    grad_y: y's shape, x.dtype. Returns grad_x like x, in the same split layout. Masks are
    inclusive: mode 0 [A <= limit] on the gate, mode 1 [A * sigmoid(A) <= limit]; both modes
    [-limit <= B <= limit] on the linear half. Rows past sum(group_index) are +0. Not twice
    differentiable (MoeError). Errors as clipped_swiglu.
    """
    grad_y, x, group_index = grad_y.contiguous(), x.contiguous(), _contig(group_index)
    planned = _C.plan_clipped_swiglu_grad(_dl(grad_y), _dl(x), _dlo(group_index), dim, alpha,
                                          limit, bias, interleaved, clamp_mode)
    (grad_x,) = _execute(planned, x)
    return grad_x


@clipped_swiglu_grad.register_fake
def _(grad_y, x, group_index=None, *, dim=-1, alpha=1.702, limit=7.0, bias=1.0,
      interleaved=True, clamp_mode=0):
    _same_device("clipped_swiglu_grad", ("x", x), ("grad_y", grad_y),
                 ("group_index", group_index))
    _halved("clipped_swiglu_grad", x, dim)
    return x.new_empty(x.shape)


def _setup(ctx, inputs, keyword_only_inputs, output):
    x, group_index = (tuple(inputs) + (None,))[:2]
    ctx.attrs = dict(keyword_only_inputs)
    ctx.save_for_backward(x, group_index)


def _backward(ctx, grad_y):
    x, group_index = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None
    return clipped_swiglu_grad(grad_y, x, group_index, **ctx.attrs), None


clipped_swiglu.register_autograd(_backward, setup_context=_setup)
