"""moegrad: fused Mixture-of-Experts training operators for PyTorch, on CPUs and NVIDIA GPUs.

Every function takes and returns torch.Tensors, is a ``torch.library`` custom op in the
namespace ``moegrad`` (``torch.ops.moegrad.<name>``, with a fake kernel for torch.compile), and
raises :class:`MoeError` (``.code`` = aclnn status) on invalid input. The three forwards are
differentiable through the three backward operators. Signatures: docs/operators.md §7.2;
semantics, shapes, dtypes and status codes: docs/operators.md; decisions: docs/decisions.md.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C
from ._errors import MoeError
from . import _ops

_C._set_error_class(MoeError)

__version__ = "0.1.0"

__all__ = [
    "MoeError",
    "moe_gating_top_k",
    "moe_gating_top_k_backward",
    "moe_finalize_routing",
    "moe_finalize_routing_grad",
    "swiglu_group",
    "swiglu_group_quant_backward",
    "swiglu_group_quant",
    "moe_init_routing",
    "moe_init_routing_grad",
    "set_num_threads",
    "get_num_threads",
]


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
    return _ops.moe_gating_top_k(x, k, bias, k_group, group_count,
                                 group_select_mode, renorm, norm_type, out_flag,
                                 routed_scaling_factor, eps)


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
    return _ops.moe_gating_top_k_backward(x_norm, grad_y, expert_idx, renorm,
                                          norm_type, routed_scaling_factor, eps)


def moe_finalize_routing(expanded_x: Tensor, expanded_row_idx: Tensor,
                         x1: Optional[Tensor] = None, x2: Optional[Tensor] = None,
                         bias: Optional[Tensor] = None, scales: Optional[Tensor] = None,
                         expert_idx: Optional[Tensor] = None, drop_pad_mode: int = 0,
                         k: int = 1) -> Tensor:
    """Unpermute and combine expert outputs per token (MoeFinalizeRoutingV2, §4, D6-D8).

    out[r] = x1[r] + x2[r] + sum_k scales[r,k] * (expanded_x[idx(r,k)] + bias[expert_idx[r,k]])
    with idx(r,k) = expanded_row_idx[k*R + r] (drop_pad_mode 0/1, column layout) or
    [r*K + k] (2/3, row layout). Modes 0/2: expanded_x (R*K, H); modes 1/3: (E, C, H) and
    index -1 marks a dropped slot (it keeps its scale * bias term). Missing scales count as 1.
    R = scales/expert_idx/x1 rows, else len(expanded_row_idx) // k. Returns (R, H) in
    expanded_x's dtype. Differentiable in every mode w.r.t. expanded_x, scales, x1, x2 (their
    gradient is grad_y) and bias (per-expert sum of scale * grad_y, dropped slots included; D23).
    Errors: MoeError 161001/161002, 561103 (shapes, index values).
    """
    return _ops.moe_finalize_routing(expanded_x, expanded_row_idx, x1, x2, bias,
                                     scales, expert_idx, drop_pad_mode, k)


def moe_finalize_routing_grad(grad_y: Tensor, expanded_row_idx: Tensor,
                              expanded_x: Optional[Tensor] = None,
                              scales: Optional[Tensor] = None,
                              expert_idx: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                              drop_pad_mode: int = 0, active_num: int = 0, expert_num: int = 0,
                              expert_capacity: int = 0) -> Tuple[Tensor, Tensor]:
    """Gradients of finalize routing w.r.t. expanded_x and scales (V2Grad, §3, D4-D7).

    grad_y: (R, H); expanded_row_idx: (R*K,) int32 in ROW layout (r*K + k). Mode 0 (dropless):
    grad_expanded_x (rows, H), rows = active_num if 0 < active_num < R*K else R*K; indices
    >= rows are skipped. Mode 1 (drop-pad): (expert_num, expert_capacity, H), -1 = dropped.
    Unaddressed rows are zero. grad_scales: (R, K) in scales' dtype, sum_j (expanded_x + bias)
    * grad_y (bias-only for skipped slots); (R, 1) zeros in grad_y's dtype without scales.
    Errors: MoeError 161001/161002, 561103.
    """
    return _ops.moe_finalize_routing_grad(grad_y, expanded_row_idx, expanded_x,
                                          scales, expert_idx, bias, drop_pad_mode,
                                          active_num, expert_num, expert_capacity)


def swiglu_group(x: Tensor, weight: Optional[Tensor] = None, group_index: Optional[Tensor] = None,
                 clamp_limit: float = -1.0) -> Tensor:
    """SwiGLU with per-token weight, clamp and MoE group truncation (§6.4, D9, D11, L8).

    x: [..., 2H] float32/float16/bfloat16, split into gate x0 and up x1. With clamp_limit c > 0:
    x0 <- min(x0, c), x1 <- clamp(x1, -c, c). y = silu(x0) * x1 * weight[t] for token rows
    t < sum(group_index) (all rows without group_index), 0 after. weight: float32 with T
    elements (T = product of leading dims; [T], [T, 1], [B, S] ...). Returns [..., H] x.dtype.
    Differentiable w.r.t. x and weight. Errors: MoeError 161001/161002, 561002.
    """
    return _ops.swiglu_group(x, weight, group_index, clamp_limit)


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
    return _ops.swiglu_group_quant_backward(grad_y, x, weight, y_origin,
                                            group_index, clamp_limit)


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
    return _ops.swiglu_group_quant(x, weight, group_index, scale, int(dst_type),
                                   quant_mode, block_size, round_scale,
                                   clamp_limit, dst_type_max, output_origin)


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
    return _ops.moe_init_routing(x, expert_idx, active_num, expert_capacity,
                                 expert_num, drop_pad_mode, expert_tokens_num_type,
                                 expert_tokens_num_flag, rng, row_idx_type)


def moe_init_routing_grad(grad_expanded_x: Tensor, expanded_row_idx: Tensor, top_k: int,
                          drop_pad_mode: int = 0, active_num: int = 0) -> Tensor:
    """Backward of moe_init_routing (MoeInitRoutingV2Grad, docs/operators.md §8.9, D29).

    grad_expanded_x: [rows, H] (mode 0; rows = R*K, or min(active_num, R*K) when
    active_num > 0) or [E, C, H] (mode 1); expanded_row_idx: [R*K] int32 src->dst. Returns
    grad_x [R, H]: per token the fp32 sum, in k order, of its rows; -1 and rows >= rows are
    skipped. Errors: MoeError 161001/161002, 561103.
    """
    return _ops.moe_init_routing_grad(grad_expanded_x, expanded_row_idx, top_k,
                                      drop_pad_mode, active_num)


def set_num_threads(n: int) -> None:
    """CPU threads of the kernels (n <= 0: OpenMP default). Results do not depend on it (D16)."""
    _C.set_num_threads(n)


def get_num_threads() -> int:
    """CPU threads the kernels use."""
    return _C.get_num_threads()


from . import nn  # noqa: E402,F401  (moegrad.nn.MoE; imports the functions above)
