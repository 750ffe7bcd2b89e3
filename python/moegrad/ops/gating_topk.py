"""Gating top-k: the router's forward and its backward (docs/operators.md §1, §2).

Registration, fake kernels and autograd of moe_gating_top_k and moe_gating_top_k_backward;
the C++ side is src/ops/gating_topk/.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _C
from ._registry import _args, _contig, _dl, _dlo, _execute, _op, _same_device


@_op("moegrad::moe_gating_top_k")
def moe_gating_top_k(x: Tensor, k: int, bias: Optional[Tensor] = None, k_group: int = 1,
                     group_count: int = 1, group_select_mode: int = 0, renorm: int = 0,
                     norm_type: int = 0, out_flag: bool = False,
                     routed_scaling_factor: float = 1.0,
                     eps: float = 1e-20) -> Tuple[Tensor, Tensor, Tensor]:
    """Router: normalise logits, pick the top-k experts per token (§2, D13, L1-L3).

    x: [M, N] float32/float16/bfloat16 logits, 1 <= N <= 2048. bias: [N] x.dtype, added to the
    scores for selection only. norm_type 0 softmax, 1 sigmoid, 2 sqrt(softplus). With
    group_count > 1 the N experts form group_count contiguous groups; only the best k_group
    groups (group_select_mode 0: group max, 1: sum of its top two) stay eligible. Ties go to
    the lower index. Weights are renormalised by (sum + eps) for norm_type 1/2, or 0 with
    renorm=1, then multiplied by routed_scaling_factor.

    Returns (y [M, k] x.dtype, expert_idx [M, k] int32, norm_out [M, N] float32 — the scores
    without bias when out_flag, zeros otherwise). Differentiable w.r.t. x for every norm_type
    (a gradient reaching norm_out is included).
    Errors: MoeError 161001/161002 (null, dtype), 561002 (shapes, attributes).
    """
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


@_op("moegrad::moe_gating_top_k_backward", no_double_backward=(
    "its gradient w.r.t. the normalised scores x_norm is not implemented; for second-order "
    "gradients of the router differentiate a PyTorch formula of moe_gating_top_k"))
def moe_gating_top_k_backward(x_norm: Tensor, grad_y: Tensor, expert_idx: Tensor,
                              renorm: int = 0, norm_type: int = 1,
                              routed_scaling_factor: float = 1.0, eps: float = 1e-20) -> Tensor:
    """Gradient of the gating top-k w.r.t. the logits (docs/operators.md §1, D1-D3, D15, D22).

    x_norm: [M, N] float32, the forward's normalised scores (norm_out): sigmoid (norm_type 1,
    the default), softmax (norm_type 0, with renorm 0 or 1 as in the forward) or
    sqrt(softplus) (norm_type 2, always renormalised); 2 <= N <= 2048. grad_y: [M, K] float32/
    float16/bfloat16; expert_idx: [M, K] int32 (int64 accepted) in [0, N), repeats summed.
    Returns grad_x [M, N] in grad_y's dtype. Errors: MoeError 161002 for every rule.
    """
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
