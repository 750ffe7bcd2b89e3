"""Finalize routing: unpermute and combine the expert outputs (docs/operators.md §3, §4, §7.3).

Registration, fake kernels and autograd of moe_finalize_routing, moe_finalize_routing_grad
and the internal moe_finalize_routing_bias_grad; the C++ side is src/ops/finalize_routing/.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _C
from .._errors import ERR_FINALIZE_ROUTING, MoeError
from .init_routing import ROW_LAYOUT_TAG
from ._registry import (_args, _contig, _dl, _dlo, _execute, _needs, _op, _ranks,
                        _same_device)


def _refuse_row_layout(idx, x1, scales, expert_idx, drop_pad_mode, k):
    """Modes 0/1 read slot k*R + r; moe_init_routing's index holds slot r*K + k. The two agree
    only when R == 1 or K == 1."""
    first = next((t for t in (scales, expert_idx, x1) if t is not None), None)
    rows = first.shape[0] if first is not None and first.dim() > 0 else idx.numel() // max(k, 1)
    choices = idx.numel() // rows if rows > 0 else 0
    if rows > 1 and choices > 1:
        raise MoeError(
            "moe_finalize_routing: drop_pad_mode: must be 2 (dropless) or 3 (drop/pad) for the "
            "expanded_row_idx of moe_init_routing, which is in row layout (slot r*K + k; modes "
            f"0 and 1 read slot k*R + r); got {drop_pad_mode}", ERR_FINALIZE_ROUTING)


@_op("moegrad::moe_finalize_routing")
def moe_finalize_routing(expanded_x: Tensor, expanded_row_idx: Tensor,
                         x1: Optional[Tensor] = None, x2: Optional[Tensor] = None,
                         bias: Optional[Tensor] = None, scales: Optional[Tensor] = None,
                         expert_idx: Optional[Tensor] = None, drop_pad_mode: int = 0,
                         k: int = 1, padded: bool = False) -> Tensor:
    """Unpermute and combine expert outputs per token (MoeFinalizeRoutingV2, §4, D6-D8).

    out[r] = x1[r] + x2[r] + sum_k scales[r,k] * (expanded_x[idx(r,k)] + bias[expert_idx[r,k]])
    with idx(r,k) = expanded_row_idx[k*R + r] (drop_pad_mode 0/1, column layout) or
    [r*K + k] (2/3, row layout). Modes 0/2: expanded_x (R*K, H); modes 1/3: (E, C, H) and
    index -1 marks a dropped slot (it keeps its scale * bias term). Missing scales count as 1.
    R = scales/expert_idx/x1 rows, else len(expanded_row_idx) // k. Returns (R, H) in
    expanded_x's dtype. Differentiable in every mode w.r.t. expanded_x, scales, x1, x2 (their
    gradient is grad_y) and bias (per-expert sum of scale * grad_y, dropped slots included; D23).
    padded=True (modes 0/2): expanded_x is the aligned layout of moe_init_routing(align_block)
    and may have more than R*K rows; padding rows are never read and get zero gradient (D36).
    An expanded_row_idx straight from moe_init_routing (row layout) is refused in modes 0/1
    when R > 1 and K > 1, where the column reading would combine the wrong rows (eager calls;
    docs/decisions.md L171; moegrad.moe_unpermute picks the mode itself).
    Errors: MoeError 161001/161002, 561103 (shapes, index values, that layout mismatch).
    """
    if drop_pad_mode in (0, 1) and getattr(expanded_row_idx, ROW_LAYOUT_TAG, False):
        _refuse_row_layout(expanded_row_idx, x1, scales, expert_idx, drop_pad_mode, k)
    expanded_x, idx = expanded_x.contiguous(), expanded_row_idx.contiguous()
    eidx = _contig(expert_idx)
    x1, x2, bias, scales = _contig(x1), _contig(x2), _contig(bias), _contig(scales)
    planned = _C.plan_moe_finalize_routing(_dl(expanded_x), _dl(idx), _dlo(x1), _dlo(x2),
                                           _dlo(bias), _dlo(scales), _dlo(eidx), drop_pad_mode, k,
                                           padded)
    (out,) = _execute(planned, expanded_x)
    return out


@moe_finalize_routing.register_fake
def _(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None, expert_idx=None,
      drop_pad_mode=0, k=1, padded=False):
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
                              expert_capacity: int = 0,
                              padded_rows: int = 0) -> Tuple[Tensor, Tensor]:
    """Gradients of finalize routing w.r.t. expanded_x and scales (V2Grad, §3, D4-D7).

    grad_y: (R, H); expanded_row_idx: (R*K,) int32 in ROW layout (r*K + k). Mode 0 (dropless):
    grad_expanded_x (rows, H), rows = active_num if 0 < active_num < R*K else R*K; indices
    >= rows are skipped. Mode 1 (drop-pad): (expert_num, expert_capacity, H), -1 = dropped.
    Unaddressed rows are zero. grad_scales: (R, K) in scales' dtype, sum_j (expanded_x + bias)
    * grad_y (bias-only for skipped slots); (R, 1) zeros in grad_y's dtype without scales (or
    with scales [0, K] at R = 0, which count as absent).
    padded_rows > 0 (mode 0, active_num 0): the aligned layout of that many rows (D36).
    Errors: MoeError 161001/161002, 561103.
    """
    grad_y, idx, eidx = grad_y.contiguous(), expanded_row_idx.contiguous(), _contig(expert_idx)
    if _no_rows(scales):
        scales = None  # no elements = absent, as the vendor's wrapper sizes grad_scales (R, 1)
    expanded_x, scales, bias = _contig(expanded_x), _contig(scales), _contig(bias)
    attrs = (drop_pad_mode, active_num, expert_num, expert_capacity, padded_rows)
    planned = _C.plan_moe_finalize_routing_grad(_dl(grad_y), _dl(idx), _dlo(expanded_x),
                                                _dlo(scales), _dlo(eidx), _dlo(bias), *attrs)
    gex, gs = _execute(planned, grad_y)
    return gex, gs


@moe_finalize_routing_grad.register_fake
def _(grad_y, expanded_row_idx, expanded_x=None, scales=None, expert_idx=None, bias=None,
      drop_pad_mode=0, active_num=0, expert_num=0, expert_capacity=0, padded_rows=0):
    _same_device("moe_finalize_routing_grad", ("grad_y", grad_y),
                 ("expanded_row_idx", expanded_row_idx), ("expanded_x", expanded_x),
                 ("scales", scales), ("expert_idx", expert_idx), ("bias", bias))
    _ranks("moe_finalize_routing_grad", ERR_FINALIZE_ROUTING, ("grad_y", grad_y, 2),
           ("expanded_row_idx", expanded_row_idx, 1),
           ("scales", None if _no_rows(scales) else scales, 2))
    r, h = grad_y.shape[0], grad_y.shape[1]
    n = expanded_row_idx.shape[0]
    if drop_pad_mode == 1:
        gex = grad_y.new_empty((expert_num, expert_capacity, h))
    elif padded_rows > 0:
        gex = grad_y.new_empty((padded_rows, h))
    else:
        rows = active_num if 0 < active_num < n else n
        gex = grad_y.new_empty((rows, h))
    if scales is not None and not _no_rows(scales):
        gs = scales.new_empty((r, scales.shape[1]))
    else:
        gs = grad_y.new_empty((r, 1))
    return gex, gs


def _no_rows(scales: Optional[Tensor]) -> bool:
    """scales [0, K] (R = 0): the finalize grad counts it as absent, as the vendor's wrapper does
    when it sizes grad_scales; any other shape goes to the native checks."""
    return scales is not None and scales.dim() == 2 and scales.shape[0] == 0


def _present(t: Optional[Tensor]) -> bool:
    return t is not None and t.numel() > 0


def _finalize_setup(ctx, inputs, output):
    expanded_x, idx, x1, x2, bias, scales, expert_idx, drop_pad_mode, k, padded = _args(
        inputs, (None,) * 7 + (0, 1, False))
    ctx.mode = 0 if drop_pad_mode is None else drop_pad_mode
    ctx.padded = bool(padded)
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
    grad_y, eidx, scales = grad_y.contiguous(), expert_idx.contiguous(), _contig(scales)
    planned = _C.plan_moe_finalize_routing_bias_grad(_dl(grad_y), _dl(eidx), _dlo(scales),
                                                     expert_num)
    (grad_bias,) = _execute(planned, grad_y)
    return grad_bias


@moe_finalize_routing_bias_grad.register_fake
def _(grad_y, expert_idx, scales, expert_num):
    _same_device("moe_finalize_routing_bias_grad", ("grad_y", grad_y),
                 ("expert_idx", expert_idx), ("scales", scales))
    _ranks("moe_finalize_routing_bias_grad", ERR_FINALIZE_ROUTING, ("grad_y", grad_y, 2),
           ("expert_idx", expert_idx, 2))
    return grad_y.new_empty((expert_num, grad_y.shape[1]))


def _finalize_backward(ctx, grad_out):
    # Every differentiable input gets its gradient (D23): x1 and x2 receive grad_y, bias the
    # per-expert sum, expanded_x and scales the V2Grad op's outputs; modes 2/3 too.
    needs = _needs(ctx, 10)
    grads = [None] * 10
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
    padded_rows = 0
    if grad_mode == 1:
        active_num, expert_num, capacity = 0, expanded_x.shape[0], expanded_x.shape[1]
    elif ctx.padded:  # the aligned layout (D36): its own row count
        active_num, expert_num, capacity = 0, 0, 0
        padded_rows = expanded_x.shape[0]
    else:
        active_num, expert_num, capacity = expanded_x.shape[0], 0, 0
    gex, gs = moe_finalize_routing_grad(grad_out, idx, expanded_x, scales, expert_idx,
                                        bias if scales is not None else None, grad_mode,
                                        active_num, expert_num, capacity, padded_rows)
    grads[0] = gex if want_x else None
    if want_s:
        grads[5] = gs
    return tuple(grads)


moe_finalize_routing.register_autograd(_finalize_backward, setup_context=_finalize_setup)


# ---- double backward (L152). moe_finalize_routing_grad and moe_finalize_routing_bias_grad are
# bilinear: grad_expanded_x[d] = s * grad_y[r], grad_scales[r,k] = (expanded_x[d] + bias[e]) .
# grad_y[r] (bias only for a skipped slot), grad_bias[e] = sum s * grad_y[r]. Their gradients
# are the same gathers and scatters, written here with differentiable torch ops in fp32 (so
# higher orders follow) and rounded once to each input's dtype.
def _slots(idx: Tensor, rows: int, k: int):
    """Per flat slot i = r*K + k: its token r, its row d (clamped) and whether it is valid."""
    d = idx.long()
    valid = (d >= 0) & (d < rows)
    r = torch.div(torch.arange(d.numel(), device=d.device), k, rounding_mode="floor")
    return r, torch.where(valid, d, torch.zeros_like(d)), valid


def _finalize_grad_setup(ctx, inputs, output):
    gy, idx, ex, scales, eidx, bias, *_ = _args(inputs, (None,) * 6 + (0, 0, 0, 0))
    with_scales = scales is not None
    ctx.gex_shape = output[0].shape
    ctx.with_scales, ctx.with_bias = with_scales, with_scales and bias is not None
    ctx.save_for_backward(gy, idx, ex if with_scales else None, scales,
                          eidx if ctx.with_bias else None, bias if ctx.with_bias else None)


def _finalize_grad_backward(ctx, v_ex, v_s):
    gy, idx, ex, scales, eidx, bias = ctx.saved_tensors
    needs = _needs(ctx, 10)
    grads = [None] * 10
    n, h = gy.shape
    rows = ctx.gex_shape.numel() // h if h else 0
    k = scales.shape[1] if ctx.with_scales else 1
    r, d, valid = _slots(idx, rows, k)
    g = gy.float().index_select(0, r)                                     # [R*K, H]
    s = scales.float().reshape(-1) if ctx.with_scales else torch.ones_like(r, dtype=g.dtype)
    vs = v_s.float().reshape(-1) if (ctx.with_scales and v_s is not None) else None
    vex = v_ex.float().reshape(rows, h).index_select(0, d) if v_ex is not None else None
    gg = None
    if needs[0]:
        if vex is not None:
            gg = vex * torch.where(valid, s, torch.zeros_like(s)).unsqueeze(1)
        if vs is not None:
            xb = ex.float().reshape(rows, h).index_select(0, d) * valid.unsqueeze(1)
            if ctx.with_bias:
                xb = xb + bias.float().index_select(0, eidx.reshape(-1).long())
            gg = xb * vs.unsqueeze(1) if gg is None else gg + xb * vs.unsqueeze(1)
        if gg is not None:
            grads[0] = gg.reshape(n, k, h).sum(1).to(gy.dtype)
    if ctx.with_scales and needs[3] and vex is not None:
        grads[3] = ((vex * g).sum(1) * valid).reshape(scales.shape).to(scales.dtype)
    if vs is not None and needs[2]:
        grads[2] = g.new_zeros((rows, h)).index_add(
            0, d[valid], (g * vs.unsqueeze(1))[valid]).reshape(ex.shape).to(ex.dtype)
    if vs is not None and ctx.with_bias and needs[5]:
        grads[5] = g.new_zeros(bias.shape).index_add(
            0, eidx.reshape(-1).long(), g * vs.unsqueeze(1)).to(bias.dtype)
    return tuple(grads)


moe_finalize_routing_grad.register_autograd(_finalize_grad_backward,
                                            setup_context=_finalize_grad_setup)


def _bias_grad_setup(ctx, inputs, output):
    gy, eidx, scales, _e = inputs
    ctx.save_for_backward(gy, eidx, scales)


def _bias_grad_backward(ctx, v):
    gy, eidx, scales = ctx.saved_tensors
    needs = _needs(ctx, 4)
    n, h = gy.shape
    k = eidx.numel() // n if n else 1
    vg = v.float().index_select(0, eidx.reshape(-1).long()).reshape(n, k, h)  # v[e] per slot
    grad_gy = grad_s = None
    if needs[0]:
        w = vg if scales is None else vg * scales.float().reshape(n, k, 1)
        grad_gy = w.sum(1).to(gy.dtype)
    if scales is not None and needs[2]:
        grad_s = (vg * gy.float().unsqueeze(1)).sum(2).reshape(scales.shape).to(scales.dtype)
    return grad_gy, None, grad_s, None


moe_finalize_routing_bias_grad.register_autograd(_bias_grad_backward,
                                                 setup_context=_bias_grad_setup)
