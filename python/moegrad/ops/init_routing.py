"""Init routing: token permutation by expert (docs/operators.md §8).

Registration, fake kernels and autograd of moe_init_routing (registered with positional
arguments; the public function takes them keyword-only) and moe_init_routing_grad; the C++
side is src/ops/init_routing/.
"""
from __future__ import annotations

import operator
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _C
from .._errors import ERR_FINALIZE_ROUTING, ERR_PARAM_INVALID, MoeError
from ._registry import _args, _dl, _execute, _op, _ranks, _same_device


# Attribute set on the src->dst index moe_init_routing returns (row layout, slot r*K + k).
ROW_LAYOUT_TAG = "_moegrad_row_layout"


def _init_routing_attrs(expert_num, active_expert_range, expert_tokens_num_flag):
    """(has_range, start, end, flag): counts need E; without E and window they are off (L33)."""
    if active_expert_range is not None and len(active_expert_range) > 0:
        if len(active_expert_range) != 2:
            raise MoeError("moe_init_routing: active_expert_range: must hold 2 values [start, "
                           f"end]; got {list(active_expert_range)}", ERR_FINALIZE_ROUTING)
        start, end = int(active_expert_range[0]), int(active_expert_range[1])
        return True, start, end, bool(expert_tokens_num_flag)
    flag = bool(expert_tokens_num_flag) and expert_num > 0
    return False, 0, 0, flag


@_op("moegrad::moe_init_routing")
def _moe_init_routing(x: Tensor, expert_idx: Tensor, active_num: int = 0,
                      expert_capacity: int = 0, expert_num: int = 0, drop_pad_mode: int = 0,
                      expert_tokens_num_type: int = 1, expert_tokens_num_flag: bool = True,
                      active_expert_range: Optional[List[int]] = None,
                      row_idx_type: int = 0,
                      align_block: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The registered schema of moe_init_routing (torch.ops.moegrad.moe_init_routing): every
    argument positional, active_expert_range a list; a fourth output, padded_offsets ([0]
    unless align_block > 1). Public function: moe_init_routing.
    """
    x, eidx = x.contiguous(), expert_idx.contiguous()
    has_range, start, end, flag = _init_routing_attrs(expert_num, active_expert_range,
                                                      expert_tokens_num_flag)
    attrs = (active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_num_type,
             flag, has_range, start, end, row_idx_type, align_block)
    ex, idx, tokens, offsets = _execute(_C.plan_moe_init_routing(_dl(x), _dl(eidx), *attrs), x)
    return ex, idx, tokens, offsets


@_moe_init_routing.register_fake
def _(x, expert_idx, active_num=0, expert_capacity=0, expert_num=0, drop_pad_mode=0,
      expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=None,
      row_idx_type=0, align_block=0):
    _same_device("moe_init_routing", ("x", x), ("expert_idx", expert_idx))
    _ranks("moe_init_routing", ERR_FINALIZE_ROUTING, ("x", x, 2), ("expert_idx", expert_idx, 2))
    r, h = x.shape[0], x.shape[1]
    n = r * expert_idx.shape[1]
    has_range, start, end, flag = _init_routing_attrs(expert_num, active_expert_range,
                                                      expert_tokens_num_flag)
    bins = (end - start) if has_range else expert_num
    if drop_pad_mode == 1:
        ex = x.new_empty((expert_num, expert_capacity, h))
    elif align_block > 1:
        ex = x.new_empty((n + bins * (align_block - 1), h))
    else:
        ex = x.new_empty((min(active_num, n) if active_num > 0 else n, h))
    if not flag:
        tshape = (0,)
    elif expert_tokens_num_type == 2:
        tshape = (expert_num, 2)
    else:
        tshape = ((end - start) if has_range else expert_num,)
    offsets = x.new_empty((bins + 1 if align_block > 1 else 0,), dtype=torch.int64)
    return (ex, x.new_empty((n,), dtype=torch.int32), x.new_empty(tshape, dtype=torch.int64),
            offsets)


@_op("moegrad::moe_init_routing_grad")
def moe_init_routing_grad(grad_expanded_x: Tensor, expanded_row_idx: Tensor, top_k: int,
                          drop_pad_mode: int = 0, active_num: int = 0,
                          padded_rows: int = 0) -> Tensor:
    """Backward of moe_init_routing (MoeInitRoutingV2Grad, docs/operators.md §8.9, D29).

    grad_expanded_x: [rows, H] (mode 0; rows = R*K, or min(active_num, R*K) when
    active_num > 0) or [E, C, H] (mode 1); expanded_row_idx: [R*K] int32 src->dst. Returns
    grad_x [R, H]: per token the fp32 sum, in k order, of its rows; -1 and rows >= rows are
    skipped. padded_rows > 0 (mode 0, active_num 0): grad_expanded_x is the aligned layout of
    moe_init_routing(align_block=m) with that many rows (D36, docs/operators.md §8.13).
    Errors: MoeError 161001/161002, 561103.
    """
    g, idx = grad_expanded_x.contiguous(), expanded_row_idx.contiguous()
    (gx,) = _execute(_C.plan_moe_init_routing_grad(_dl(g), _dl(idx), top_k, drop_pad_mode,
                                                   active_num, padded_rows), g)
    return gx


@moe_init_routing_grad.register_fake
def _(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=0, active_num=0, padded_rows=0):
    _same_device("moe_init_routing_grad", ("grad_expanded_x", grad_expanded_x),
                 ("expanded_row_idx", expanded_row_idx))
    return grad_expanded_x.new_empty((expanded_row_idx.shape[0] // top_k,
                                      grad_expanded_x.shape[-1]))


def _init_routing_setup(ctx, inputs, output):
    (x, expert_idx, active_num, _cap, _e, drop_pad_mode, _tt, _tf, _rng,
     row_idx_type, align_block) = _args(inputs, (None, None, 0, 0, 0, 0, 1, True, None, 0, 0))
    ex, idx, _tok, _off = output
    ctx.padded_rows = ex.shape[0] if align_block > 1 else 0
    ctx.k = expert_idx.shape[1]
    ctx.mode = drop_pad_mode
    ctx.active_num = max(int(active_num), 0)
    ctx.row_idx_type = row_idx_type
    ctx.save_for_backward(idx)


def _init_routing_backward(ctx, grad_ex, _grad_idx, _grad_tok, _grad_off):
    if ctx.row_idx_type != 0:
        raise NotImplementedError(
            "moegrad.moe_init_routing: backward needs row_idx_type=0 (the src->dst index); "
            f"got row_idx_type={ctx.row_idx_type} (decisions.md D25)")
    (idx,) = ctx.saved_tensors
    gx = moe_init_routing_grad(grad_ex, idx, ctx.k, ctx.mode,
                               ctx.active_num if ctx.mode == 0 else 0, ctx.padded_rows)
    return (gx,) + (None,) * 10


_moe_init_routing.register_autograd(_init_routing_backward, setup_context=_init_routing_setup)


def moe_init_routing(x: Tensor, expert_idx: Tensor, *, active_num: int = 0,
                     expert_capacity: int = 0, expert_num: int = 0, drop_pad_mode: int = 0,
                     expert_tokens_num_type: int = 1, expert_tokens_num_flag: bool = True,
                     active_expert_range: Optional[Sequence[int]] = None,
                     row_idx_type: int = 0, align_block: int = 0) -> Tuple[Tensor, ...]:
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
    align_block m > 1 (D36, docs/operators.md §8.13; dropless, active_num 0, row_idx_type 0,
    expert_num > 0): each expert's block starts at a multiple of m and is padded with zero rows
    to a multiple of m; expanded_x has R*K + bins*(m - 1) rows (bins = experts of the window),
    the index points into that layout, the counts stay the real ones, and a fourth output is
    returned: padded_offsets [bins + 1] int64, block b = rows [offsets[b], offsets[b + 1]).
    Pass padded=True to moe_finalize_routing for this layout.
    Differentiable w.r.t. x (via moe_init_routing_grad). Feed expanded_row_idx to
    moe_finalize_routing with drop_pad_mode 2 (modes 0) or 3 (drop/pad); modes 0/1 refuse it
    when R > 1 and K > 1 (docs/decisions.md L171). moegrad.moe_permute / moe_unpermute pair
    the two for you (docs/layer.md "Permute and unpermute").
    Returns (expanded_x, expanded_row_idx, counts), plus padded_offsets when align_block > 1.
    Errors: MoeError 161001/161002, 561103 (shapes, attributes, expert ids).
    """
    rng = None
    if active_expert_range is not None:
        try:  # integers as given: int() would turn 1.5 into 1 before any message (L154)
            rng = [operator.index(v) for v in active_expert_range]
        except TypeError:
            raise MoeError("moe_init_routing: active_expert_range: must hold integers; got "
                           f"{active_expert_range!r}", ERR_PARAM_INVALID) from None
    out = _moe_init_routing(x, expert_idx, active_num, expert_capacity, expert_num,
                            drop_pad_mode, expert_tokens_num_type, expert_tokens_num_flag, rng,
                            row_idx_type, align_block)
    if row_idx_type == 0 and not torch.compiler.is_compiling():
        # Marks the index as row layout so that moe_finalize_routing can refuse it in the
        # column-layout modes 0/1 (docs/decisions.md L171); eager only, lost on copies.
        setattr(out[1], ROW_LAYOUT_TAG, True)
    return out if align_block > 1 else out[:3]


# ---- double backward (L152): moe_init_routing_grad is linear in grad_expanded_x, a gather-sum
# of its rows per token; its gradient scatters each token's upstream row back to the rows the
# token's slots address (the forward's expanded_x with x = the upstream gradient). Exact (copies)
# and made of differentiable torch ops, so higher orders follow.
def _init_routing_grad_setup(ctx, inputs, output):
    g, idx, top_k, _mode, _active, _padded = _args(inputs, (None, None, None, 0, 0, 0))
    ctx.g_shape, ctx.top_k = g.shape, top_k
    ctx.save_for_backward(idx)


def _init_routing_grad_backward(ctx, grad_gx):
    if grad_gx is None or not ctx.needs_input_grad[0]:
        return (None,) * 6
    (idx,) = ctx.saved_tensors
    h = ctx.g_shape[-1]
    rows = ctx.g_shape.numel() // h if h else 0  # mode 1: [E, C, H] viewed as [E*C, H]
    idx = idx.long()
    valid = (idx >= 0) & (idx < rows)
    slots = valid.nonzero().squeeze(1)
    src = grad_gx.index_select(0, torch.div(slots, ctx.top_k, rounding_mode="floor"))
    gg = grad_gx.new_zeros((rows, h)).index_add(0, idx[slots], src)
    return (gg.reshape(ctx.g_shape),) + (None,) * 5


moe_init_routing_grad.register_autograd(_init_routing_grad_backward,
                                        setup_context=_init_routing_grad_setup)
