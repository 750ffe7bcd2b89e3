"""Gating top-k: the router's forward, its replay and its backward (docs/operators.md §1, §2).

Registration, fake kernels and autograd of moe_gating_top_k, moe_gating_replay (§2.8) and
moe_gating_top_k_backward; the C++ side is src/ops/gating_topk/.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _C
from .._errors import ERR_INNER_TILING
from ._registry import _args, _contig, _dl, _dlo, _execute, _op, _ranks, _same_device


@_op("moegrad::moe_gating_top_k")
def moe_gating_top_k(x: Tensor, k: int, bias: Optional[Tensor] = None, k_group: int = 1,
                     group_count: int = 1, group_select_mode: int = 0, renorm: int = 0,
                     norm_type: int = 0, out_flag: bool = False,
                     routed_scaling_factor: float = 1.0,
                     eps: float = 1e-20, no_renorm: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Router: normalise logits, pick the top-k experts per token (§2, D13, L1-L3).

    x: [M, N] float32/float16/bfloat16 logits, 1 <= N <= 2048. bias: [N] x.dtype, added to the
    scores for selection only. norm_type 0 softmax, 1 sigmoid, 2 sqrt(softplus). With
    group_count > 1 the N experts form group_count contiguous groups; only the best k_group
    groups (group_select_mode 0: group max, 1: sum of its top two) stay eligible. Ties go to
    the lower index. Weights are renormalised by (sum + eps) for norm_type 1/2, or 0 with
    renorm=1, then multiplied by routed_scaling_factor. no_renorm=True never renormalises, for
    every norm_type (D33, docs/operators.md §2.4): y = routed_scaling_factor * score[ids].

    Returns (y [M, k] x.dtype, expert_idx [M, k] int32, norm_out [M, N] float32 — the scores
    without bias when out_flag, zeros otherwise). Differentiable w.r.t. x for every norm_type
    (a gradient reaching norm_out is included).
    Errors: MoeError 161001/161002 (null, dtype), 561002 (shapes, attributes).
    """
    x, bias = x.contiguous(), _contig(bias)
    attrs = (k, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
             routed_scaling_factor, eps, no_renorm)
    y, idx, norm = _execute(_C.plan_moe_gating_top_k(_dl(x), _dlo(bias), *attrs), x)
    return y, idx, norm


@moe_gating_top_k.register_fake
def _(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
      out_flag=False, routed_scaling_factor=1.0, eps=1e-20, no_renorm=False):
    _same_device("moe_gating_top_k", ("x", x), ("bias", bias))
    _ranks("moe_gating_top_k", ERR_INNER_TILING, ("x", x, 2))
    m, n = x.shape[0], x.shape[1]
    return (x.new_empty((m, k)), x.new_empty((m, k), dtype=torch.int32),
            x.new_empty((m, n), dtype=torch.float32))


@_op("moegrad::moe_gating_top_k_backward", no_double_backward=(
    "its gradient w.r.t. the normalised scores x_norm is not implemented; for second-order "
    "gradients of the router differentiate a PyTorch formula of moe_gating_top_k"))
def moe_gating_top_k_backward(x_norm: Tensor, grad_y: Tensor, expert_idx: Tensor,
                              renorm: int = 0, norm_type: int = 1,
                              routed_scaling_factor: float = 1.0, eps: float = 1e-20,
                              no_renorm: bool = False) -> Tensor:
    """Gradient of the gating top-k w.r.t. the logits (docs/operators.md §1, D1-D3, D15, D22).

    x_norm: [M, N] float32, the forward's normalised scores (norm_out): sigmoid (norm_type 1,
    the default), softmax (norm_type 0, with renorm 0 or 1 as in the forward) or
    sqrt(softplus) (norm_type 2, always renormalised); 2 <= N <= 2048. grad_y: [M, K] float32/
    float16/bfloat16; expert_idx: [M, K] int32 (int64 accepted) in [0, N), repeats summed.
    no_renorm: as the forward's (D33): the weights were the scores themselves.
    Returns grad_x [M, N] in grad_y's dtype. Errors: MoeError 161002 for every rule.
    """
    x_norm, grad_y, expert_idx = x_norm.contiguous(), grad_y.contiguous(), expert_idx.contiguous()
    attrs = (renorm, norm_type, routed_scaling_factor, eps, no_renorm)
    planned = _C.plan_moe_gating_top_k_backward(_dl(x_norm), _dl(grad_y), _dl(expert_idx), *attrs)
    (grad_x,) = _execute(planned, grad_y)
    return grad_x


@moe_gating_top_k_backward.register_fake
def _(x_norm, grad_y, expert_idx, renorm=0, norm_type=1, routed_scaling_factor=1.0, eps=1e-20,
      no_renorm=False):
    _same_device("moe_gating_top_k_backward", ("x_norm", x_norm), ("grad_y", grad_y),
                 ("expert_idx", expert_idx))
    return grad_y.new_empty(x_norm.shape)


def _gating_setup(ctx, inputs, output):
    x, _k, _bias, _kg, _gc, _gsm, renorm, norm_type, out_flag, rsf, eps, no_renorm = _args(
        inputs, (None, None, None, 1, 1, 0, 0, 0, False, 1.0, 1e-20, False))
    _y, idx, norm = output
    # The backward needs the scores: norm_out when it holds them (out_flag), else x to
    # recompute them. Only that one is kept (norm_out is zeros without out_flag): a router's
    # saved state is then one [M, N] tensor, as in a PyTorch softmax router. Saved as
    # (scores or x, ids), the layout of moe_gating_replay's: an activation checkpoint whose
    # recomputation replays the ids (moegrad.nn, fp32 logits) sees the same saved tensors.
    ctx.save_for_backward(norm if out_flag else x, idx)
    ctx.x_dtype = x.dtype
    ctx.attrs = (renorm, norm_type, out_flag, rsf, eps, no_renorm)


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


def _weights_and_scores_backward(x_dtype, x_norm, idx, grad_y, grad_norm, attrs):
    """grad_x of (y, norm_out) at the saved scores x_norm (fp32): the native backward of the
    weights plus, when norm_out receives a gradient, its normalisation backward; both terms
    are summed in fp32 and rounded once (D12)."""
    renorm, norm_type, rsf, eps, no_renorm = attrs
    two_terms = grad_norm is not None
    grad_x = moe_gating_top_k_backward(x_norm, grad_y.float() if two_terms else grad_y, idx,
                                       renorm, norm_type, rsf, eps, no_renorm)
    if two_terms:
        grad_x = (grad_x + _normalise_backward(grad_norm.float(), x_norm, norm_type)).to(x_dtype)
    return grad_x


def _gating_backward(ctx, grad_y, _grad_idx, grad_norm):
    # Every norm type (D22, L21): the native backward takes the forward's normalised scores.
    renorm, norm_type, out_flag, rsf, eps, no_renorm = ctx.attrs
    scores_or_x, idx = ctx.saved_tensors
    x_norm = scores_or_x if out_flag else _normalise(scores_or_x, norm_type)
    grad_x = _weights_and_scores_backward(ctx.x_dtype, x_norm, idx, grad_y,
                                          grad_norm if out_flag else None,
                                          (renorm, norm_type, rsf, eps, no_renorm))
    return (grad_x,) + (None,) * 11


moe_gating_top_k.register_autograd(_gating_backward, setup_context=_gating_setup)


@_op("moegrad::moe_gating_replay")
def moe_gating_replay(x: Tensor, expert_idx: Tensor, bias: Optional[Tensor] = None,
                      renorm: int = 0, norm_type: int = 0, routed_scaling_factor: float = 1.0,
                      eps: float = 1e-20, no_renorm: bool = False) -> Tuple[Tensor, Tensor]:
    """The router at given expert ids: routing replay (docs/operators.md §2.8, D33, D34).

    x: [M, N] float32/float16/bfloat16 logits, 1 <= N <= 2048; expert_idx: [M, K] int32 or
    int64, 1 <= K <= N, the ids to use (a rollout's or an earlier forward's choice). No
    selection happens: the weights are the current scores at those ids, normalised, renormalised
    (norm_type 1/2, or 0 with renorm=1; never with no_renorm=True), eps and
    routed_scaling_factor applied exactly as moe_gating_top_k would. bias: [N] x.dtype, checked
    and unused (the selection bias only ranks). Host ids must lie in [0, N) with no id twice in
    a row (161002 naming row and value); out-of-range device ids get weight 0 (D6).
    Returns (y [M, K] x.dtype, norm_out [M, N] float32, the scores, always written).
    Differentiable w.r.t. x: the backward is moe_gating_top_k_backward (plus the scores' own
    gradient when norm_out is used). Replaying the ids moe_gating_top_k chose gives its y bit
    for bit. Errors: MoeError 161001/161002, 561002 (shapes, attributes).
    """
    x, idx, bias = x.contiguous(), expert_idx.contiguous(), _contig(bias)
    attrs = (renorm, norm_type, routed_scaling_factor, eps, no_renorm)
    y, norm = _execute(_C.plan_moe_gating_replay(_dl(x), _dl(idx), _dlo(bias), *attrs), x)
    return y, norm


@moe_gating_replay.register_fake
def _(x, expert_idx, bias=None, renorm=0, norm_type=0, routed_scaling_factor=1.0, eps=1e-20,
      no_renorm=False):
    _same_device("moe_gating_replay", ("x", x), ("expert_idx", expert_idx), ("bias", bias))
    _ranks("moe_gating_replay", ERR_INNER_TILING, ("x", x, 2), ("expert_idx", expert_idx, 2))
    return (x.new_empty((x.shape[0], expert_idx.shape[1])),
            x.new_empty((x.shape[0], x.shape[1]), dtype=torch.float32))


def _replay_setup(ctx, inputs, output):
    x, idx, _bias, renorm, norm_type, rsf, eps, no_renorm = _args(
        inputs, (None, None, None, 0, 0, 1.0, 1e-20, False))
    _y, norm = output
    ctx.save_for_backward(norm, idx)  # norm_out always holds the scores: x is not kept
    ctx.x_dtype = x.dtype
    ctx.attrs = (renorm, norm_type, rsf, eps, no_renorm)


def _replay_backward(ctx, grad_y, grad_norm):
    norm, idx = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros((idx.shape[0], idx.shape[1]), dtype=ctx.x_dtype, device=idx.device)
    grad_x = _weights_and_scores_backward(ctx.x_dtype, norm, idx, grad_y, grad_norm, ctx.attrs)
    return (grad_x,) + (None,) * 7


moe_gating_replay.register_autograd(_replay_backward, setup_context=_replay_setup)
