"""Init routing: token permutation by expert (docs/operators.md §8).

Registration, fake kernels and autograd of moe_init_routing (registered with positional
arguments; the public function takes them keyword-only) and moe_init_routing_grad; the C++
side is src/ops/init_routing/.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _C
from .._errors import ERR_FINALIZE_ROUTING, MoeError
from ._registry import _args, _dl, _execute, _op, _same_device


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
def _moe_init_routing(x: Tensor, expert_idx: Tensor, active_num: int = 0,
                      expert_capacity: int = 0, expert_num: int = 0, drop_pad_mode: int = 0,
                      expert_tokens_num_type: int = 1, expert_tokens_num_flag: bool = True,
                      active_expert_range: Optional[List[int]] = None,
                      row_idx_type: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """The registered schema of moe_init_routing (torch.ops.moegrad.moe_init_routing): every
    argument positional, active_expert_range a list. Public function: moe_init_routing.
    """
    if x.is_cuda:
        # ---- CUDA backend: no CUDA kernel for this op yet; computed on the CPU (synchronises,
        # not capturable in a CUDA graph; docs/cuda.md) ----
        outs = _moe_init_routing(x.cpu(), expert_idx.cpu(), active_num, expert_capacity,
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


@_moe_init_routing.register_fake
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
    """Backward of moe_init_routing (MoeInitRoutingV2Grad, docs/operators.md §8.9, D29).

    grad_expanded_x: [rows, H] (mode 0; rows = R*K, or min(active_num, R*K) when
    active_num > 0) or [E, C, H] (mode 1); expanded_row_idx: [R*K] int32 src->dst. Returns
    grad_x [R, H]: per token the fp32 sum, in k order, of its rows; -1 and rows >= rows are
    skipped. Errors: MoeError 161001/161002, 561103.
    """
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


_moe_init_routing.register_autograd(_init_routing_backward, setup_context=_init_routing_setup)


def moe_init_routing(x: Tensor, expert_idx: Tensor, *, active_num: int = 0,
                     expert_capacity: int = 0, expert_num: int = 0, drop_pad_mode: int = 0,
                     expert_tokens_num_type: int = 1, expert_tokens_num_flag: bool = True,
                     active_expert_range: Optional[Sequence[int]] = None,
                     row_idx_type: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """Token permutation: group token rows by expert (MoeInitRoutingV2/V3, docs/operators.md §8).

    x: [R, H] float32/float16/bfloat16; expert_idx: [R, K] int32 (int64 accepted). The R*K
    slots (flat s = r*K + k) are sorted by expert id, stably (ties: lower slot first), and
    expanded_x[d] = x[S[d] // K] for the sorted slot list S.
    - drop_pad_mode 0: expanded_x [R*K, H]; active_num A > 0 keeps only the first min(A, R*K)
      sorted rows (the index keeps its full values).
    - drop_pad_mode 1: expanded_x [expert_num, expert_capacity, H]; per expert the lowest
      tokens are kept, extra slots get index -1, missing rows are zero.
    - active_expert_range [start, end): only those experts are materialised (in order); other
      slots get -1 and trailing rows are zero.
    expanded_row_idx: [R*K] int32, src->dst (slot -> expanded row, -1 = none) with
    row_idx_type 0; the dst->src slot order with row_idx_type 1 (no autograd).
    Counts (int64): expert_tokens_num_type 0 cumsum, 1 count ([end - start], or [expert_num]),
    2 key-value ([expert_num, 2] rows (id, count), then zeros); [0] when the flag is off or
    expert_num is 0 without a window. Drop/pad counts are before capacity.
    Differentiable w.r.t. x (via moe_init_routing_grad). Feed expanded_row_idx to
    moe_finalize_routing with drop_pad_mode 2 (modes 0) or 3 (drop/pad).
    Errors: MoeError 161001/161002, 561103 (shapes, attributes, expert ids).
    """
    rng = None if active_expert_range is None else [int(v) for v in active_expert_range]
    return _moe_init_routing(x, expert_idx, active_num, expert_capacity, expert_num,
                             drop_pad_mode, expert_tokens_num_type, expert_tokens_num_flag, rng,
                             row_idx_type)
