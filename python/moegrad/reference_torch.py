"""Plain-PyTorch formulas of the moegrad operators (eager and torch.compile baselines).

These are what a careful PyTorch user would write for the same semantics, vectorised over tokens
(the only Python loops run over the top-k slots K <= 8, never over tokens). They follow the
numerics of the library (docs/operators.md §0.4, decisions.md D12): fp16/bf16 inputs are widened
to fp32, all arithmetic is fp32, and each output is narrowed once at the end.

They serve the benchmark (``python -m moegrad.bench``): timing baselines and a cheap sanity
check of moegrad's outputs. They are NOT the test oracle -- the tests compare the library with
the independent float64 reference in tests/python/reference.py. Tie order in the gating top-k
follows ``torch.topk`` (not guaranteed stable), so exact index comparison needs tie-free data.

Signatures mirror the public moegrad functions (docs/operators.md §7.2); every function is free of
host synchronisation (no ``.item()``) so that torch.compile can trace it as one graph.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "moe_gating_top_k", "gating_weights", "moe_gating_top_k_backward",
    "moe_finalize_routing", "moe_finalize_routing_grad",
    "swiglu_group", "swiglu_group_quant_backward",
    "moe_init_routing", "moe_init_routing_grad",
    "clipped_swiglu", "clipped_swiglu_grad",
]


# ---------------------------------------------------------------------------------------------
# Gating top-k (§2, D13, L1) and its backward (§1, D1)
# ---------------------------------------------------------------------------------------------
def _normalise(xf: Tensor, norm_type: int) -> Tensor:
    if norm_type == 0:
        return torch.softmax(xf, dim=-1)
    if norm_type == 1:
        return torch.sigmoid(xf)
    return torch.sqrt(torch.nn.functional.softplus(xf))


def gating_weights(norm: Tensor, expert_idx: Tensor, renorm: int, norm_type: int,
                   routed_scaling_factor: float, eps: float, dtype: torch.dtype) -> Tensor:
    """Steps 5-7 of §2.4: gather the unbiased scores of the chosen experts, renormalise, scale."""
    g = norm.gather(1, expert_idx.long())
    if norm_type in (1, 2) or renorm == 1:
        g = g / (g.sum(dim=1, keepdim=True) + eps)
    return (g * routed_scaling_factor).to(dtype)


def moe_gating_top_k(x: Tensor, k: int, bias: Optional[Tensor] = None, k_group: int = 1,
                     group_count: int = 1, group_select_mode: int = 0, renorm: int = 0,
                     norm_type: int = 0, out_flag: bool = False,
                     routed_scaling_factor: float = 1.0,
                     eps: float = 1e-20) -> Tuple[Tensor, Tensor, Tensor]:
    """(y [M,k] x.dtype, expert_idx [M,k] int32, norm_out [M,N] fp32; zeros unless out_flag)."""
    m, n = x.shape
    norm = _normalise(x.float(), norm_type)
    score = norm if bias is None else norm + bias.float()
    if group_count > 1 and k_group < group_count:
        grouped = score.view(m, group_count, n // group_count)
        if group_select_mode == 0:
            gscore = grouped.amax(dim=-1)
        else:
            gscore = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = gscore.topk(k_group, dim=-1).indices
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, keep, True)
        score = grouped.masked_fill(~gmask.unsqueeze(-1), float("-inf")).view(m, n)
    idx = score.topk(k, dim=-1).indices
    y = gating_weights(norm, idx, renorm, norm_type, routed_scaling_factor, eps, x.dtype)
    norm_out = norm if out_flag else torch.zeros_like(norm)
    return y, idx.to(torch.int32), norm_out


def moe_gating_top_k_backward(x_norm: Tensor, grad_y: Tensor, expert_idx: Tensor,
                              renorm: int = 0, norm_type: int = 1,
                              routed_scaling_factor: float = 1.0,
                              eps: float = 1e-20) -> Tensor:
    """grad_x [M,N] in grad_y's dtype (sigmoid path, §1.5; repeated ids summed, D1)."""
    idx = expert_idx.long()
    gs = grad_y.float() * routed_scaling_factor
    w_raw = x_norm.gather(1, idx)
    d = w_raw.sum(dim=1, keepdim=True) + eps
    beta = (w_raw / d * gs).sum(dim=1, keepdim=True)
    g = (gs - beta) / d
    big_g = torch.zeros_like(x_norm).scatter_add_(1, idx, g)
    return (x_norm * (1.0 - x_norm) * big_g).to(grad_y.dtype)


# ---------------------------------------------------------------------------------------------
# Finalize routing V2 forward (§4, D7, D8, L4, L5) and grad (§3, D5, D6, D7)
# ---------------------------------------------------------------------------------------------
def moe_finalize_routing(expanded_x: Tensor, expanded_row_idx: Tensor,
                         x1: Optional[Tensor] = None, x2: Optional[Tensor] = None,
                         bias: Optional[Tensor] = None, scales: Optional[Tensor] = None,
                         expert_idx: Optional[Tensor] = None, drop_pad_mode: int = 0,
                         k: int = 1) -> Tensor:
    """out [R,H] = x1 + x2 + sum_k scales * (expanded_x[idx] + bias[expert]) in expanded_x.dtype."""
    hidden = expanded_x.shape[-1]
    rows_x = expanded_x.reshape(-1, hidden)
    n_rows = rows_x.shape[0]
    if scales is not None:
        r, kk = scales.shape
    elif expert_idx is not None:
        r, kk = expert_idx.shape
    elif x1 is not None:
        r = x1.shape[0]
        kk = expanded_row_idx.shape[0] // r
    else:
        kk = k
        r = expanded_row_idx.shape[0] // kk
    idx = expanded_row_idx.long()
    # column layout (k*R + r) for modes 0/1, row layout (r*K + k) for 2/3 (D8)
    idx_rk = idx.view(kk, r).t() if drop_pad_mode in (0, 1) else idx.view(r, kk)
    out = torch.zeros((r, hidden), dtype=torch.float32, device=expanded_x.device)
    if x1 is not None:
        out = out + x1.float()
    if x2 is not None:
        out = out + x2.float()
    for j in range(kk):  # K <= 8 slots; each step is vectorised over all R tokens
        d = idx_rk[:, j]
        valid = (d >= 0) & (d < n_rows)
        term = rows_x.index_select(0, d.clamp(0, n_rows - 1)).float()
        term = torch.where(valid.unsqueeze(1), term, 0.0)  # dropped / skipped slot (D7, L5)
        if bias is not None:
            term = term + bias.index_select(0, expert_idx[:, j].long()).float()
        if scales is not None:
            term = term * scales[:, j:j + 1].float()
        out = out + term
    return out.to(expanded_x.dtype)


def moe_finalize_routing_grad(grad_y: Tensor, expanded_row_idx: Tensor,
                              expanded_x: Optional[Tensor] = None,
                              scales: Optional[Tensor] = None,
                              expert_idx: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                              drop_pad_mode: int = 0, active_num: int = 0, expert_num: int = 0,
                              expert_capacity: int = 0) -> Tuple[Tensor, Tensor]:
    """(grad_expanded_x, grad_scales); indices in row layout r*K + k; holes zero-filled."""
    r, hidden = grad_y.shape
    n_idx = expanded_row_idx.shape[0]
    kk = scales.shape[1] if scales is not None else 1
    if drop_pad_mode == 1:
        rows = expert_num * expert_capacity
        gex_shape = (expert_num, expert_capacity, hidden)
    else:
        rows = active_num if 0 < active_num < n_idx else n_idx
        gex_shape = (rows, hidden)
    idx = expanded_row_idx.long().view(r, kk)
    gyf = grad_y.float()
    gex = torch.zeros((rows + 1, hidden), dtype=grad_y.dtype, device=grad_y.device)
    if scales is None:
        gs = torch.zeros((r, 1), dtype=grad_y.dtype, device=grad_y.device)
    else:
        gs = torch.empty((r, kk), dtype=torch.float32, device=grad_y.device)
        xrows = expanded_x.reshape(-1, hidden)
    for j in range(kk):  # K <= 8 slots; each step is vectorised over all R tokens
        d = idx[:, j]
        valid = (d >= 0) & (d < rows)
        dst = torch.where(valid, d, rows)  # invalid slots write into a scratch row
        val = gyf if scales is None else gyf * scales[:, j:j + 1].float()
        gex.index_copy_(0, dst, val.to(grad_y.dtype))
        if scales is not None:
            xv = xrows.index_select(0, d.clamp(0, rows - 1)).float()
            xv = torch.where(valid.unsqueeze(1), xv, 0.0)
            if bias is not None:
                xv = xv + bias.index_select(0, expert_idx[:, j].long()).float()
            gs[:, j] = (xv * gyf).sum(dim=1)
    gex = gex[:rows].view(gex_shape)
    if scales is not None:
        gs = gs.to(scales.dtype)
    return gex, gs


# ---------------------------------------------------------------------------------------------
# SwiGLU forward (§6.4, D9, D11, L8) and backward (§5.5, D10)
# ---------------------------------------------------------------------------------------------
def _row_mask(x: Tensor, group_index: Optional[Tensor]) -> Optional[Tensor]:
    """[T] bool: rows below trunc = clamp(sum(group_index), 0, T); None = every row."""
    if group_index is None:
        return None
    t = x.numel() // x.shape[-1]
    # Exact (Python integers): an int64 sum of huge or garbage counts would wrap around (L52).
    total = sum(int(v) for v in group_index.reshape(-1).tolist())
    trunc = max(0, min(total, t))
    return torch.arange(t, device=x.device) < trunc


def _halves(x: Tensor, clamp_limit: float):
    xf = x.float().reshape(-1, x.shape[-1])
    h = xf.shape[1] // 2
    x0, x1 = xf[:, :h], xf[:, h:]
    if clamp_limit > 0:
        return x0, x1, x0.clamp(max=clamp_limit), x1.clamp(-clamp_limit, clamp_limit)
    return x0, x1, x0, x1


def swiglu_group(x: Tensor, weight: Optional[Tensor] = None, group_index: Optional[Tensor] = None,
                 clamp_limit: float = -1.0) -> Tensor:
    """y [...,H] = silu(x0') * x1' * weight[t], zero for rows >= sum(group_index)."""
    _, _, x0c, x1c = _halves(x, clamp_limit)
    y = torch.nn.functional.silu(x0c) * x1c
    if weight is not None:
        y = y * weight.reshape(-1, 1)
    mask = _row_mask(x, group_index)
    if mask is not None:
        y = torch.where(mask.unsqueeze(1), y, 0.0)
    return y.to(x.dtype).reshape(*x.shape[:-1], x.shape[-1] // 2)


def swiglu_group_quant_backward(grad_y: Tensor, x: Tensor, weight: Optional[Tensor] = None,
                                y_origin: Optional[Tensor] = None,
                                group_index: Optional[Tensor] = None,
                                clamp_limit: float = -1.0) -> Tuple[Tensor, Tensor]:
    """(grad_x like x, grad_weight fp32 like weight or [0]) of the SwiGLU above (§5.5)."""
    x0, x1, x0c, x1c = _halves(x, clamp_limit)
    gy = grad_y.float().reshape(x0.shape)
    gy0 = gy * weight.reshape(-1, 1) if weight is not None else gy
    sig = torch.sigmoid(x0c)
    silu = x0c * sig
    dsilu = sig * (1.0 + x0c * (1.0 - sig))
    gx0 = gy0 * x1c * dsilu
    gx1 = gy0 * silu
    if clamp_limit > 0:
        gx0 = torch.where(x0 < clamp_limit, gx0, 0.0)
        gx1 = torch.where((x1 > -clamp_limit) & (x1 < clamp_limit), gx1, 0.0)
    grad_x = torch.cat([gx0, gx1], dim=1)
    mask = _row_mask(x, group_index)
    if mask is not None:
        grad_x = torch.where(mask.unsqueeze(1), grad_x, 0.0)
    grad_x = grad_x.to(x.dtype).reshape(x.shape)
    if weight is None:
        return grad_x, torch.empty((0,), dtype=torch.float32, device=x.device)
    gw = (gy * y_origin.float().reshape(gy.shape)).sum(dim=1)
    if mask is not None:
        gw = torch.where(mask, gw, 0.0)
    return grad_x, gw.reshape(weight.shape)


def swiglu_group_quant(x: Tensor, weight: Optional[Tensor] = None,
                       group_index: Optional[Tensor] = None, scale: Optional[Tensor] = None, *,
                       dst_type=torch.float8_e4m3fn, quant_mode: int = 0, block_size: int = 0,
                       round_scale: bool = False, clamp_limit: float = -1.0,
                       dst_type_max: float = 15.0, output_origin: bool = False):
    """(y fp8, y_scale, y_origin) of §6.4, FP8 blocks (quant_mode 0) or MX (1), in fp32."""
    if not isinstance(dst_type, torch.dtype):
        dst_type = torch.float8_e5m2 if dst_type in (291, 23) else torch.float8_e4m3fn
    fmax = 57344.0 if dst_type == torch.float8_e5m2 else 448.0
    _, _, x0c, x1c = _halves(x, clamp_limit)
    y = torch.nn.functional.silu(x0c) * x1c
    if weight is not None:
        y = y * weight.reshape(-1, 1)
    mask = _row_mask(x, group_index)
    if mask is not None:
        y = torch.where(mask.unsqueeze(1), y, 0.0)
    T, H = y.shape
    B = 128 if quant_mode == 0 else 32
    nb = (H + B - 1) // B
    blocks = torch.nn.functional.pad(y, (0, nb * B - H)).reshape(T, nb, B)
    amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(-1, keepdim=True)
    ah = amax.clamp(min=1e-4)
    if round_scale or quant_mode == 1:
        sc = torch.exp2(torch.ceil(torch.log2(ah / fmax)))
        inv = 1.0 / sc
    else:
        sc, inv = ah / fmax, fmax / ah
    q = (blocks * inv).reshape(T, nb * B)[:, :H].to(dst_type)
    sc = sc.reshape(T, nb)
    if mask is not None:
        sc = torch.where(mask.unsqueeze(1), sc, 0.0)
    lead = x.shape[:-1]
    if quant_mode == 1:
        sc = torch.nn.functional.pad(sc, (0, 2 * ((nb + 1) // 2) - nb)).reshape(*lead, -1, 2)
        sc = sc.to(torch.float8_e8m0fnu)
    else:
        sc = sc.reshape(*lead, nb)
    y_origin = (y.to(x.dtype).reshape(*lead, H) if output_origin
                else torch.empty((0,), dtype=x.dtype, device=x.device))
    return q.reshape(*lead, H), sc, y_origin
# ---------------------------------------------------------------------------------------------
# Token permutation (§8): init routing (dropless, counts) and its grad
# ---------------------------------------------------------------------------------------------
def moe_init_routing(x: Tensor, expert_idx: Tensor, *, active_num: int = 0,
                     expert_capacity: int = 0, expert_num: int = 0, drop_pad_mode: int = 0,
                     expert_tokens_num_type: int = 1, expert_tokens_num_flag: bool = True,
                     active_expert_range=None, row_idx_type: int = 0):
    """Dropless permutation: (x rows sorted by expert, src->dst index int32, counts int64)."""
    if drop_pad_mode != 0 or active_num > 0 or active_expert_range or row_idx_type != 0:
        raise NotImplementedError("reference_torch.moe_init_routing: dropless mode only")
    K = expert_idx.shape[1]
    flat = expert_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    idx = torch.empty_like(order)
    idx[order] = torch.arange(order.numel(), device=order.device)
    ex = x.index_select(0, order // K)
    if expert_tokens_num_flag and expert_num > 0:
        counts = torch.bincount(flat, minlength=expert_num)
        if expert_tokens_num_type == 0:
            counts = counts.cumsum(0)
    else:
        counts = torch.zeros(0, dtype=torch.int64, device=x.device)
    return ex, idx.to(torch.int32), counts


def moe_init_routing_grad(grad_expanded_x: Tensor, expanded_row_idx: Tensor, top_k: int,
                          drop_pad_mode: int = 0, active_num: int = 0) -> Tensor:
    """grad_x [R, H]: per token the fp32 sum of its valid rows, narrowed once."""
    hidden = grad_expanded_x.shape[-1]
    g = grad_expanded_x.reshape(-1, hidden)
    n_rows = g.shape[0]
    idx = expanded_row_idx.long().view(-1, top_k)
    out = torch.zeros((idx.shape[0], hidden), dtype=torch.float32, device=g.device)
    for j in range(top_k):
        d = idx[:, j]
        valid = (d >= 0) & (d < n_rows)
        term = g.index_select(0, d.clamp(0, max(n_rows - 1, 0))).float()
        out = out + torch.where(valid.unsqueeze(1), term, 0.0)
    return out.to(grad_expanded_x.dtype)


# ---------------------------------------------------------------------------------------------
# The GPT-OSS activation (ClippedSwiglu, docs/operators.md §9) as transformers' GptOssExperts
# writes it: in the input's dtype, gate and up interleaved, clamp mode 0. The benchmark's
# baseline; its backward is torch.autograd's.
# ---------------------------------------------------------------------------------------------
def clipped_swiglu(x: Tensor, group_index: Optional[Tensor] = None, *, dim: int = -1,
                   alpha: float = 1.702, limit: float = 7.0, bias: float = 1.0,
                   interleaved: bool = True, clamp_mode: int = 0) -> Tensor:
    """(up' + bias) * gate' * sigmoid(gate' * alpha) over the last dim (dim -1, clamp_mode 0 and
    no group_index only: the GPT-OSS case)."""
    if dim not in (-1, x.dim() - 1) or clamp_mode != 0 or group_index is not None:
        raise NotImplementedError("reference_torch.clipped_swiglu: the GPT-OSS case only")
    if interleaved:
        gate, up = x[..., ::2], x[..., 1::2]
    else:
        gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + bias) * glu


def clipped_swiglu_grad(grad_y: Tensor, x: Tensor, group_index: Optional[Tensor] = None,
                        **attrs) -> Tensor:
    """grad_x of clipped_swiglu above by torch.autograd (forward included)."""
    with torch.enable_grad():
        xl = x.detach().requires_grad_(True)
        (gx,) = torch.autograd.grad(clipped_swiglu(xl, group_index, **attrs), xl, grad_y)
    return gx
