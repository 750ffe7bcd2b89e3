"""moegrad.nn.MoE: a Mixture-of-Experts feed-forward layer on moegrad's fused operators.

router (moe_gating_top_k) -> moe_init_routing -> per-expert SwiGLU MLPs (stacked weights, a
grouped GEMM where torch has one, swiglu_group) -> moe_finalize_routing with the routing
weights. Optional: shared experts, capacity (drop/pad), the aux-loss-free selection-bias update
(DeepSeek-V3), a Switch-style load-balancing loss, a clamp limit (GPT-OSS) and expert
parallelism over a torch.distributed process group. docs/layer.md describes it; the choices it
makes are docs/decisions.md L37-L39.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

import moegrad as _mg  # the public functions, looked up at call time (patchable in tests)
from moegrad.ops._registry import _op
from moegrad.ops.swiglu import _swiglu_group_backward_over_x

__all__ = ["MoE", "expert_parameters", "non_expert_parameters", "all_reduce_non_expert_grads"]


# ------------------------------------------------------------------------------ expert GEMMs --
def _grouped_mm_ok(x: Tensor, w: Tensor) -> bool:
    """torch._grouped_mm serves this call: CUDA bf16 on sm90+ with 16-byte-multiple strides (no
    host sync there). Everything else goes through moegrad::grouped_mm (L37)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or not x.is_cuda:
        return False
    es = x.element_size()
    if (w.shape[-2] * es) % 16 or (w.shape[-1] * es) % 16:
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


def _host_sizes(counts: Tensor, rows: Tensor, *weights: Tensor,
                bias: bool = False) -> Optional[Tensor]:
    """The CPU copy of the expert sizes that the expert GEMMs of rows with `weights` need, or
    None. On CUDA, torch._grouped_mm reads the sizes on the device; where moegrad::grouped_mm
    serves a pass (a bias, or a case torch._grouped_mm does not take) it reads them on the host,
    and one copy then serves all the passes, forward and backward."""
    if not counts.is_cuda or (not bias and all(_grouped_mm_ok(rows, w) for w in weights)):
        return None
    return counts.cpu()


def _slices(counts: Tensor, rows: int) -> List[int]:
    """Expert sizes on the host; rows past sum(counts) (none in the layer) form a last slice
    that no expert owns."""
    sizes = [int(c) for c in counts.tolist()]
    rest = rows - sum(sizes)
    if rest < 0 or min(sizes, default=0) < 0:
        raise ValueError(f"grouped_mm: counts: must be >= 0 and sum to at most the {rows} rows "
                         f"of x; got sum {sum(sizes)}")
    return sizes + [rest]


def _mm_layout(w: Tensor) -> bool:
    """Each w[e] is a matrix BLAS reads in place: unit stride along one of its two dims (a
    contiguous [E, A, B] tensor, or the transpose view of a contiguous [E, B, A] one)."""
    return w.dim() == 3 and (w.stride(-1) == 1 or w.stride(-2) == 1)


def _like_layout(like: Tensor, w: Tensor) -> Tensor:
    """An uninitialised tensor shaped like w, in w's per-expert layout (row- or column-major):
    the weight gradient a transposed view receives then reaches its parameter without a copy."""
    if w.stride(-1) == 1 or w.shape[-1] == 1:
        return like.new_empty(w.shape)
    return like.new_empty((w.shape[0], w.shape[2], w.shape[1])).transpose(1, 2)


@_op("moegrad::grouped_mm")
def _grouped_mm_op(x: Tensor, w: Tensor, counts: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [rows, A] grouped by expert (counts [E]) times w [E, A, B] (+ bias [E, B] per expert)
    -> [rows, B]; rows past sum(counts) are zero. One GEMM per expert written in place into its
    slice of the output, and an opaque operator, so torch.compile keeps one graph around it.
    Its outputs (and its backward's) are plain allocations, not advised onto huge pages (L102):
    with transparent huge pages on `madvise`, an advised fault may wait for memory compaction."""
    sizes = _slices(counts, x.shape[0])
    out = x.new_empty((x.shape[0], w.shape[-1]))
    outs, xs = out.split(sizes), x.split(sizes)
    for e in range(len(sizes) - 1):
        if sizes[e]:
            if bias is None:
                torch.mm(xs[e], w[e], out=outs[e])
            else:
                torch.addmm(bias[e], xs[e], w[e], out=outs[e])
    outs[-1].zero_()
    return out


@_grouped_mm_op.register_fake
def _(x, w, counts, bias=None):
    return x.new_empty((x.shape[0], w.shape[-1]))


@_op("moegrad::grouped_mm_backward")
def _grouped_mm_backward_op(grad: Tensor, x: Tensor, w: Tensor, counts: Tensor, need_x: bool,
                            need_w: bool, need_b: bool = False) -> List[Tensor]:
    """(grad_x [rows, A] or [0], grad_w [E, A, B] in w's layout or [0], grad_bias [E, B] or
    [0]) of grouped_mm. grad_w is written expert by expert into one stacked tensor: no
    per-expert full-size zero tensors (what autograd of `xe @ w[e]` accumulates), and experts
    without rows get zeros."""
    sizes = _slices(counts, x.shape[0])
    gx = grad.new_empty(x.shape) if need_x else grad.new_empty((0,))
    gw = _like_layout(grad, w) if need_w else grad.new_empty((0,))
    gb = grad.new_empty((w.shape[0], w.shape[-1])) if need_b else grad.new_empty((0,))
    gs, xs = grad.split(sizes), x.split(sizes)
    gxs = gx.split(sizes) if need_x else None
    for e in range(len(sizes) - 1):
        if need_x and sizes[e]:
            torch.mm(gs[e], w[e].t(), out=gxs[e])
        if need_w:
            if sizes[e]:
                torch.mm(xs[e].t(), gs[e], out=gw[e])
            else:
                gw[e].zero_()
        if need_b:
            torch.sum(gs[e], 0, out=gb[e])
    if need_x:
        gxs[-1].zero_()
    return [gx, gw, gb]


@_grouped_mm_backward_op.register_fake
def _(grad, x, w, counts, need_x, need_w, need_b=False):
    return [grad.new_empty(x.shape if need_x else (0,)),
            _like_layout(grad, w) if need_w else grad.new_empty((0,)),
            grad.new_empty((w.shape[0], w.shape[-1]) if need_b else (0,))]


def _grouped_mm_setup(ctx, inputs, output):
    x, w, counts = inputs[:3]
    bias = inputs[3] if len(inputs) > 3 else None
    ctx.has_bias = bias is not None
    ctx.n_inputs = len(inputs)  # torch drops a trailing default bias: one gradient per input
    ctx.save_for_backward(x, w, counts)


def _grouped_mm_bwd(ctx, grad):
    x, w, counts = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and len(ctx.needs_input_grad) > 3 and ctx.needs_input_grad[3]
    gx, gw, gb = _grouped_mm_backward_op(grad.contiguous(), x, w, counts, need_x, need_w,
                                         need_b)
    grads = (gx if need_x else None), (gw if need_w else None), None, (gb if need_b else None)
    return grads[:ctx.n_inputs]


_grouped_mm_op.register_autograd(_grouped_mm_bwd, setup_context=_grouped_mm_setup)


# Double backward (L152): the backward is bilinear (grad_x_e = g_e w_e^T, grad_w_e = x_e^T g_e),
# so its gradients are again grouped products, through the two ops above (higher orders follow).
def _grouped_mm_backward_setup(ctx, inputs, output):
    grad, x, w, counts, need_x, need_w = inputs[:6]
    ctx.need = (need_x, need_w, len(inputs) > 6 and inputs[6])
    # One gradient per input as torch counts them: it drops a trailing need_b equal to its
    # default (False), even one passed explicitly.
    ctx.n_inputs = 7 if ctx.need[2] else 6
    ctx.save_for_backward(grad, x, w, counts)


def _grouped_mm_backward_bwd(ctx, grads):
    v_gx, v_gw, v_gb = grads  # the op returns a list: its gradients come as one
    grad, x, w, counts = ctx.saved_tensors
    need_x, need_w, need_b = ctx.need
    v_gx = v_gx if need_x else None
    v_gw = v_gw if need_w else None
    v_gb = v_gb if need_b else None
    want = ctx.needs_input_grad
    d_grad = d_x = d_w = None
    if want[0]:
        parts = [_grouped_mm_op(v.contiguous(), m, counts)
                 for v, m in ((v_gx, w), (x, v_gw)) if v is not None and m is not None]
        if v_gb is not None:  # grad_bias[e] sums expert e's rows of grad: each row gets v_gb[e]
            sizes = _slices(counts, grad.shape[0])
            per_row = torch.repeat_interleave(v_gb, torch.tensor(sizes[:-1]), dim=0)
            parts.append(torch.cat([per_row, v_gb.new_zeros((sizes[-1], v_gb.shape[1]))]))
        d_grad = sum(parts[1:], parts[0]) if parts else None
    if want[1] and v_gw is not None:
        d_x = _grouped_mm_op(grad, v_gw.transpose(1, 2).contiguous(), counts)
    if want[2] and v_gx is not None:
        d_w = _grouped_mm_backward_op(grad, v_gx.contiguous(), w, counts, False, True)[1]
    return (d_grad, d_x, d_w) + (None,) * (ctx.n_inputs - 3)


_grouped_mm_backward_op.register_autograd(_grouped_mm_backward_bwd,
                                          setup_context=_grouped_mm_backward_setup)


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor,
               host_counts: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
    """rows [sum(counts), A] grouped by expert (counts [E] int64) times w [E, A, B] (+ bias
    [E, B], each expert's row added to its rows) -> [rows, B]. w may be the transpose view of a
    contiguous [E, B, A] tensor (the layout transformers stores): it is read, and its gradient
    written, in place, with no copy. torch._grouped_mm on CUDA bf16 sm90+ without bias, else the
    operator moegrad::grouped_mm (differentiable, compiles without a graph break; it reads the
    expert sizes on the host, from host_counts (a CPU copy of counts) when given: then a CUDA
    call syncs for neither its forward nor its backward)."""
    if bias is None and _grouped_mm_ok(x, w) and x.shape[0] > 0:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    return _grouped_mm_op(x.contiguous(), w if _mm_layout(w) else w.contiguous(),
                          counts if host_counts is None else host_counts,
                          None if bias is None else bias.contiguous())


# ------------------------------------------------------ the activation's gradient over `up` --
def _transforms_active() -> bool:
    """torch.func transforms (vmap, grad, jacrev) or forward-mode AD, which the autograd
    Functions here (and moegrad.hf's) do not implement (False while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return False
    from torch.autograd import forward_ad
    return bool(torch._C._are_functorch_transforms_active()) or forward_ad._current_level >= 0


def _over_up_ok(up: Tensor) -> bool:
    """Whether the SiLU activation's backward may write its gradient over `up` (L228): eager, on
    the CPU (where a new buffer is faulted in page by page; CUDA's allocator reuses blocks), up
    a plain tensor (not a FakeTensor or another subclass) needing a gradient, no dispatch mode
    (FakeTensorMode, an op logger: they see the operator), torch.func transform or forward AD."""
    return (type(up) is Tensor and up.device.type == "cpu" and up.requires_grad
            and not torch.compiler.is_compiling() and _current_dispatch_mode() is None
            and not _transforms_active())


class _SwigluOverUp(torch.autograd.Function):
    """swiglu_group(up, group_index=counts, clamp_limit=clamp) whose backward writes the gradient
    of `up` over `up` itself (L228), with the clamp limit grad_clamp. `up` must be a tensor that
    no other autograd node reads: the output of the GEMM regen(counts, *operands) (or its bias
    add). A second backward through the same graph (retain_graph) finds `up` overwritten and
    first recomputes it with regen from the saved operands. With regen None, and under
    create_graph, the gradient goes to a new tensor through the registered operator."""

    @staticmethod
    def forward(ctx, up, counts, clamp, grad_clamp, regen, operands):
        ctx.grad_clamp, ctx.regen, ctx.spent = grad_clamp, regen, False
        ctx.save_for_backward(up, counts, *operands)
        return _mg.swiglu_group(up, group_index=counts, clamp_limit=clamp)

    @staticmethod
    def backward(ctx, grad_y):
        up, counts, *operands = ctx.saved_tensors
        if ctx.spent:  # with create_graph the recomputed rows keep their graph (L151 holds)
            up = ctx.regen(counts, *operands)
        if (ctx.regen is None or torch.is_grad_enabled() or type(up) is not Tensor
                or _current_dispatch_mode() is not None):
            # create_graph: the operator records the graph, and a second-order gradient through
            # it raises its "double backward is not supported" error (L150, L151). A mode
            # entered around the backward sees the operator.
            grad, _ = _mg.swiglu_group_quant_backward(grad_y, up, group_index=counts,
                                                      clamp_limit=ctx.grad_clamp)
        else:
            ctx.spent = True
            grad = _swiglu_group_backward_over_x(grad_y, up, counts, ctx.grad_clamp)
        return grad, None, None, None, None, None


def _autocast(*ts: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """ts, each cast to autocast's dtype for its device where autocast is on there and it is a
    floating tensor other than float64 (the casts torch's own linear and matmul get under
    autocast; L230); None and every other tensor as given."""
    out = []
    for t in ts:
        if (t is not None and t.is_floating_point() and t.dtype != torch.float64
                and torch.is_autocast_enabled(t.device.type)):
            dt = torch.get_autocast_dtype(t.device.type)
            t = t if t.dtype == dt else t.to(dt)
        out.append(t)
    return tuple(out)


# The up GEMMs of the layer: the forward calls them, and _SwigluOverUp calls them again to
# recompute an overwritten `up` (L228), so the two are the same computation by construction.
def _regen_grouped(counts: Tensor, rows: Tensor, w: Tensor, bias: Optional[Tensor],
                   host: Optional[Tensor] = None) -> Tensor:
    return MoE._add_bias(grouped_mm(rows, w, counts, host), bias, counts)


def _regen_padded(_counts, rows: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
    return MoE._add_bias(torch.bmm(rows, w), bias, None)


def _regen_mm(_counts, x: Tensor, w: Tensor) -> Tensor:
    return x @ w


# -------------------------------------------------------------------- expert-parallel comms --
class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: List[int], in_splits: List[int], group):
        import torch.distributed as dist
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        g = g.contiguous()
        out = g.new_empty((sum(ctx.in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(out, g, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the backward passes the gradient through unchanged: every rank
    computes the same loss from the sum, and the data-parallel gradient all-reduce later adds
    the ranks' parts (torch.distributed.nn's all_reduce would sum them here already)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


def all_to_all(x: Tensor, out_splits: List[int], in_splits: List[int], group) -> Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


# ------------------------------------------------------------------------ argument checks --
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fail(exc, name, rule, value):
    raise exc(f"MoE: {name}: {rule}; got {value!r}")


def _check_arguments(*, hidden, ffn_hidden, num_experts, top_k, score, n_group, topk_group,
                     routed_scaling_factor, clamp_limit, capacity_factor, shared_experts,
                     bias_update_speed, aux_loss_coef, dtype):
    """The layer's arguments, checked when it is built, in its own names (L172): TypeError for
    a wrong type, ValueError for a wrong value. The operators would refuse most of these only
    at the first forward, in their names (k, k_group, group_count)."""
    for name, v, lo in (("hidden", hidden, 1), ("ffn_hidden", ffn_hidden, 1),
                        ("num_experts", num_experts, 1), ("top_k", top_k, 1),
                        ("n_group", n_group, 1), ("topk_group", topk_group, 1),
                        ("shared_experts", shared_experts, 0)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            _fail(TypeError, name, "must be an int", v)
        if v < lo:
            _fail(ValueError, name, f"must be >= {lo}", v)
    for name, v in (("routed_scaling_factor", routed_scaling_factor),
                    ("clamp_limit", clamp_limit), ("bias_update_speed", bias_update_speed),
                    ("aux_loss_coef", aux_loss_coef)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            _fail(TypeError, name, "must be a number", v)
        if not math.isfinite(v):
            _fail(ValueError, name, "must be finite", v)
    if score not in ("sigmoid", "softmax"):
        _fail(ValueError, "score", "must be 'sigmoid' or 'softmax'", score)
    if top_k > num_experts:
        _fail(ValueError, "top_k", f"must be <= num_experts ({num_experts})", top_k)
    if num_experts % n_group:
        _fail(ValueError, "n_group", f"must divide num_experts ({num_experts})", n_group)
    if topk_group > n_group:
        _fail(ValueError, "topk_group", f"must be <= n_group ({n_group})", topk_group)
    per_group = num_experts // n_group
    if top_k > topk_group * per_group:
        _fail(ValueError, "top_k", f"must be <= topk_group * num_experts / n_group "
              f"({topk_group} * {per_group}: the experts of the groups a token may use)", top_k)
    if score == "sigmoid" and per_group < 2:
        _fail(ValueError, "n_group", f"must leave >= 2 experts per group with score='sigmoid' "
              f"(a group ranks by its two best scores; num_experts = {num_experts})", n_group)
    if clamp_limit != -1 and not clamp_limit > 0:
        _fail(ValueError, "clamp_limit", "must be -1 (off) or > 0", clamp_limit)
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
            _fail(TypeError, "capacity_factor", "must be None (dropless) or a number",
                  capacity_factor)
        if not (math.isfinite(capacity_factor) and capacity_factor > 0):
            _fail(ValueError, "capacity_factor", "must be None (dropless) or finite and > 0",
                  capacity_factor)
    if bias_update_speed < 0:
        _fail(ValueError, "bias_update_speed", "must be >= 0", bias_update_speed)
    if aux_loss_coef < 0:
        _fail(ValueError, "aux_loss_coef", "must be >= 0", aux_loss_coef)
    if dtype is not None and dtype not in _DTYPES:
        _fail(TypeError, "dtype", "must be None, torch.float32, torch.float16 or torch.bfloat16",
              dtype)


def _recomputing() -> bool:
    """Whether this forward runs inside a backward: an activation-checkpoint recomputation
    (L187). A compiled graph cannot ask (the query breaks the graph): there it is False."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


@torch.library.custom_op("moegrad::_accumulate_load", mutates_args=("total",))
def _accumulate_load(total: Tensor, counts: Tensor) -> None:
    """total += counts (the layer's tokens_per_expert), except inside a backward: an activation-
    checkpoint recomputation counts nothing (L187). Decided when the kernel runs, so a compiled
    layer that an eager checkpoint recomputes in backward counts nothing either (the graph
    itself cannot ask, _recomputing)."""
    if torch._C._current_graph_task_id() == -1:
        total.add_(counts.to(total.dtype))


@_accumulate_load.register_fake
def _(total, counts):
    return None


# -------------------------------------------------------------------------------- the layer --
class MoE(nn.Module):
    """A routed-expert SwiGLU feed-forward layer.

    Arguments (docs/layer.md): hidden H, ffn_hidden F (per expert), num_experts E, top_k K; score
    "sigmoid" (DeepSeek-V3: sigmoid scores, selection bias, weights renormalised over the K) or
    "softmax" (Qwen3/Mixtral/GPT-OSS: softmax, top-k weights renormalised); n_group /
    topk_group: expert groups and how many each token may use; routed_scaling_factor;
    clamp_limit (-1 off, else the GPT-OSS SwiGLU clamp); capacity_factor (None: dropless, else
    each expert keeps ceil(capacity_factor * T * K / E) rows, drop/pad); ep_group: a
    torch.distributed process group over which the experts are split (E / world size each).
    GPT-OSS experts (docs/layer.md): activation "swiglu" (silu(gate) * up, halves split,
    clamp_limit) or "clipped_swiglu" (the GPT-OSS activation, moegrad.clipped_swiglu with
    swiglu_alpha, swiglu_limit, swiglu_offset and swiglu_interleaved: gate/up interleaved in
    w_up's columns); expert_bias (b_up [E, 2F], b_down [E, H] on the two expert projections);
    router_bias (gate_bias [E], the router's linear bias). GPT-OSS itself: score="softmax",
    activation="clipped_swiglu", expert_bias=True, router_bias=True.
    Extras: shared_experts (dense SwiGLU MLPs of width shared_experts * F on every token),
    bias_update_speed (aux-loss-free balancing step, applied by update_bias()), aux_loss_coef
    (Switch-style loss E * sum_e f_e * P_e, exposed as .aux_loss after each forward).
    Routing (docs/layer.md "Routing options"; D33-D35): norm_topk_prob (False: the top-k weights
    are the scores themselves, D33; required with top_k = 1), seq_aux_loss_coef (DeepSeek-V3's
    sequence-wise loss, .seq_aux_loss), z_loss_coef (router z-loss, .z_loss), aux_loss_group (a
    process group: the Switch loss counts f over its whole batch, the global-batch variant).
    Router logits and the selection are computed in fp32 for every layer dtype.

    forward(x [T, H] or [B, S, H], mask=None) -> same shape and dtype. mask (x.shape[:-1], bool
    or 0/1): tokens where it is false are not routed, take no capacity, count in no statistic or
    loss, and get a zero output. After a forward: last_expert_idx [T_routed, K], last_load [E]
    (tokens per expert of that forward); tokens_per_expert accumulates training forwards (once
    per token, also under activation checkpointing). moegrad.nn.RoutingReplay records / replays
    the expert choices (D34).

    Errors (docs/layer.md "Arguments and errors", docs/decisions.md L172): the constructor
    checks every argument, a wrong type raises TypeError and a wrong value ValueError, with the
    message "MoE: <argument>: <rule>; got <value>"; forward raises ValueError for an x of the
    wrong shape and TypeError for an x whose dtype is not the layer's.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, *,
                 score: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, clamp_limit: float = -1.0,
                 capacity_factor: Optional[float] = None, ep_group=None,
                 shared_experts: int = 0, bias_update_speed: float = 0.0,
                 aux_loss_coef: float = 0.0, norm_topk_prob: bool = True,
                 seq_aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 aux_loss_group=None, activation: str = "swiglu",
                 expert_bias: bool = False, router_bias: bool = False,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 swiglu_offset: float = 1.0, swiglu_interleaved: bool = True,
                 device=None, dtype=None):
        super().__init__()
        _check_arguments(hidden=hidden, ffn_hidden=ffn_hidden, num_experts=num_experts,
                         top_k=top_k, score=score, n_group=n_group, topk_group=topk_group,
                         routed_scaling_factor=routed_scaling_factor, clamp_limit=clamp_limit,
                         capacity_factor=capacity_factor, shared_experts=shared_experts,
                         bias_update_speed=bias_update_speed, aux_loss_coef=aux_loss_coef,
                         dtype=dtype)
        self._init_routing_options(top_k, norm_topk_prob, seq_aux_loss_coef, z_loss_coef,
                                   aux_loss_group)
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.num_experts, self.top_k = num_experts, top_k
        self.score, self.n_group, self.topk_group = score, n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.clamp_limit = float(clamp_limit)
        self.capacity_factor = capacity_factor
        self.ep_group = ep_group
        self.bias_update_speed = float(bias_update_speed)
        self.aux_loss_coef = float(aux_loss_coef)
        self.ep_size, self.ep_rank = 1, 0
        if ep_group is not None:
            import torch.distributed as dist
            self.ep_size = dist.get_world_size(ep_group)
            self.ep_rank = dist.get_rank(ep_group)
            if num_experts % self.ep_size:
                raise ValueError(f"MoE: ep_group: its size must divide num_experts "
                                 f"({num_experts}), each rank holding num_experts / size "
                                 f"experts; got size {self.ep_size}")
            if capacity_factor is not None:
                raise NotImplementedError("MoE: capacity_factor with ep_group is not supported "
                                          "(docs/decisions.md L39)")
        self.num_local_experts = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.num_local_experts
        fk = dict(device=device, dtype=dtype)
        El = self.num_local_experts
        self.gate = nn.Parameter(torch.empty(num_experts, hidden, **fk))
        self.w_up = nn.Parameter(torch.empty(El, hidden, 2 * ffn_hidden, **fk))
        self.w_down = nn.Parameter(torch.empty(El, ffn_hidden, hidden, **fk))
        self.w_up._moegrad_expert = True
        self.w_down._moegrad_expert = True
        self.shared_hidden = shared_experts * ffn_hidden
        if shared_experts:
            self.shared_up = nn.Parameter(torch.empty(hidden, 2 * self.shared_hidden, **fk))
            self.shared_down = nn.Parameter(torch.empty(self.shared_hidden, hidden, **fk))
        else:
            self.register_parameter("shared_up", None)
            self.register_parameter("shared_down", None)
        # Selection bias (sigmoid scores only): ranking only, no gradient (DeepSeek-V3).
        self.register_buffer("selection_bias", torch.zeros(num_experts, dtype=torch.float32,
                                                           device=device))
        # Tokens per expert since the last update_bias() (this process's tokens).
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32,
                                                              device=device))
        self.aux_loss: Optional[Tensor] = None
        self.last_expert_idx: Optional[Tensor] = None   # [T, K] of the last forward
        self._init_gpt_oss(activation, expert_bias, router_bias, swiglu_alpha, swiglu_limit,
                           swiglu_offset, swiglu_interleaved, fk)
        self.reset_parameters()

    def _init_gpt_oss(self, activation, expert_bias, router_bias, alpha, limit, offset,
                      interleaved, fk):
        """The GPT-OSS pieces (docs/layer.md "GPT-OSS experts"): the activation, biases on both
        expert projections and on the router."""
        if activation not in ("swiglu", "clipped_swiglu"):
            _fail(ValueError, "activation", "must be 'swiglu' or 'clipped_swiglu'", activation)
        for name, v in (("swiglu_alpha", alpha), ("swiglu_limit", limit),
                        ("swiglu_offset", offset)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                _fail(TypeError, name, "must be a number", v)
            if not math.isfinite(v):
                _fail(ValueError, name, "must be finite", v)
        if not limit > 0:
            _fail(ValueError, "swiglu_limit", "must be > 0", limit)
        self.activation = activation
        self.swiglu_alpha, self.swiglu_limit = float(alpha), float(limit)
        self.swiglu_offset, self.swiglu_interleaved = float(offset), bool(interleaved)
        El, E = self.num_local_experts, self.num_experts
        if expert_bias:
            self.b_up = nn.Parameter(torch.zeros(El, 2 * self.ffn_hidden, **fk))
            self.b_down = nn.Parameter(torch.zeros(El, self.hidden, **fk))
            self.b_up._moegrad_expert = True
            self.b_down._moegrad_expert = True
        else:
            self.register_parameter("b_up", None)
            self.register_parameter("b_down", None)
        if router_bias:
            self.gate_bias = nn.Parameter(torch.zeros(E, **fk))
        else:
            self.register_parameter("gate_bias", None)

    def _act(self, up: Tensor, group_index: Optional[Tensor], regen, operands) -> Tensor:
        """The expert activation of up [rows, 2F] -> [rows, F]; up = regen(group_index,
        *operands), which the SiLU activation's backward may overwrite (L228)."""
        if self.activation == "clipped_swiglu":
            return _mg.clipped_swiglu(up, group_index, alpha=self.swiglu_alpha,
                                      limit=self.swiglu_limit, bias=self.swiglu_offset,
                                      interleaved=self.swiglu_interleaved)
        if _over_up_ok(up):
            return _SwigluOverUp.apply(up, group_index, self.clamp_limit, self.clamp_limit,
                                       regen, operands)
        return _mg.swiglu_group(up, group_index=group_index, clamp_limit=self.clamp_limit)

    @staticmethod
    def _add_bias(rows: Tensor, bias: Optional[Tensor], counts: Optional[Tensor]) -> Tensor:
        """rows [sum(counts), n] grouped by local expert + bias[expert] ([E_local, n]); with
        counts None, rows [E, C, n] (capacity mode). The expert of each row comes from counts
        on the device (no host sync)."""
        if bias is None:
            return rows
        if counts is None:
            return rows + bias.unsqueeze(1)
        eid = torch.repeat_interleave(torch.arange(bias.shape[0], device=rows.device), counts,
                                      output_size=rows.shape[0])
        return rows + bias.index_select(0, eid)

    def reset_parameters(self, generator: Optional[torch.Generator] = None):
        """Router N(0, 0.02); expert and shared weights N(0, 1/fan_in)."""
        with torch.no_grad():
            self.gate.normal_(0.0, 0.02, generator=generator)
            self.w_up.normal_(0.0, 1.0 / math.sqrt(self.hidden), generator=generator)
            self.w_down.normal_(0.0, 1.0 / math.sqrt(self.ffn_hidden), generator=generator)
            for b in (self.b_up, self.b_down, self.gate_bias):
                if b is not None:
                    b.zero_()
            if self.shared_up is not None:
                self.shared_up.normal_(0.0, 1.0 / math.sqrt(self.hidden), generator=generator)
                self.shared_down.normal_(0.0, 1.0 / math.sqrt(self.shared_hidden),
                                         generator=generator)

    def _apply(self, fn, *args, **kwargs):
        # .to(dtype) / .half() convert parameters; the routing buffers stay fp32 (exact counts,
        # the bias is added to fp32 scores).
        super()._apply(fn, *args, **kwargs)
        self.selection_bias = self.selection_bias.float()
        self.tokens_per_expert = self.tokens_per_expert.float()
        return self

    # -- routing options (D33-D35, docs/layer.md "Routing options") --------------------------
    def _init_routing_options(self, top_k, norm_topk_prob, seq_aux_loss_coef, z_loss_coef,
                              aux_loss_group):
        if top_k == 1 and norm_topk_prob:
            raise ValueError("MoE: norm_topk_prob: must be False with top_k = 1 (one "
                             "renormalised weight is always 1, so the router would get no "
                             "gradient); got True")
        for name, v in (("seq_aux_loss_coef", seq_aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"MoE: {name}: must be a finite number >= 0; got {v}")
        self.norm_topk_prob = bool(norm_topk_prob)
        self.seq_aux_loss_coef = float(seq_aux_loss_coef)
        self.z_loss_coef = float(z_loss_coef)
        self.aux_loss_group = aux_loss_group
        self.routing_replay = None           # set by moegrad.nn.RoutingReplay
        self._recompute_ids: List[Tensor] = []  # ids of forwards a checkpoint may recompute
        self.z_loss: Optional[Tensor] = None
        self.seq_aux_loss: Optional[Tensor] = None
        self.last_load: Optional[Tensor] = None

    # -- routing ----------------------------------------------------------------------------
    def route(self, x: Tensor, expert_idx: Optional[Tensor] = None):
        """(weights [T, K] fp32, expert_idx [T, K] int32, scores [T, E] fp32 or None). Logits
        and selection in fp32 (a bf16 logit would rank near-equal experts wrongly); with
        expert_idx given the experts are not selected but replayed (moe_gating_replay). Under
        autocast too: autocast would run the linear in its lower dtype."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.float(),
                              None if self.gate_bias is None else self.gate_bias.float())
        sigmoid = self.score == "sigmoid"
        want_scores = self.training and (self.aux_loss_coef > 0 or self.seq_aux_loss_coef > 0)
        norm = dict(renorm=0 if sigmoid else 1, norm_type=1 if sigmoid else 0,
                    routed_scaling_factor=self.routed_scaling_factor,
                    no_renorm=not self.norm_topk_prob)
        if expert_idx is None:
            y, idx, scores = _mg.moe_gating_top_k(
                logits, self.top_k, bias=self.selection_bias if sigmoid else None,
                k_group=self.topk_group, group_count=self.n_group,
                group_select_mode=1 if sigmoid else 0, out_flag=want_scores, **norm)
        else:
            idx = expert_idx.to(device=logits.device, dtype=torch.int32)
            y, scores = _mg.moe_gating_replay(logits, idx, **norm)
        self.z_loss = (self.z_loss_coef * torch.logsumexp(logits, -1).square().mean()
                       if self.z_loss_coef > 0 and self.training else None)
        return y, idx, (scores if want_scores else None)

    @torch.compiler.disable
    def _replayed_ids(self, T: int):
        """(recomputing, ids or None). A forward that runs inside backward is an activation-
        checkpoint recomputation: it takes the ids of the forward it repeats, when a replay is
        attached (L185). Otherwise a replay in progress supplies the next recorded ids."""
        recomputing = _recomputing()
        rr = self.routing_replay
        if recomputing:
            if self._recompute_ids:
                return True, self._recompute_ids.pop()
            if rr.mode == "replay":
                raise RuntimeError("RoutingReplay: replay: a recomputed forward has no ids of "
                                   "its original forward; run the backward inside replay() and "
                                   "checkpoint with use_reentrant=False or True, not both")
            return True, None
        if rr.mode == "replay":
            return False, rr._next(self, T, self.top_k)
        return False, None

    @torch.compiler.disable
    def _note_ids(self, idx: Tensor) -> None:
        """Records a forward's ids (record mode) and keeps them for a recomputation."""
        rr = self.routing_replay
        if rr.mode == "record":
            rr._push(idx)
        if self.training and rr.mode != "off":
            self._recompute_ids.append(idx.detach())

    def _routed_rows(self, mask: Tensor, shape) -> Tensor:
        """Indices of the tokens a mask keeps (a host read of their number)."""
        if tuple(mask.shape) != tuple(shape[:-1]):
            raise ValueError(f"MoE: mask: must have the shape {list(shape[:-1])} of x without "
                             f"its last dim; got {list(mask.shape)}")
        return (mask.reshape(-1) != 0).nonzero().squeeze(1)

    def _seq_aux_loss(self, p: Tensor, idx: Tensor, seq: Tensor, n_seq: int) -> Tensor:
        """DeepSeek-V3's sequence-wise balance loss (D35) from the normalised scores p [T, E]:
        per sequence b with S_b routed tokens, coef * sum_e f_be * P_be, f_be = E / (K * S_b) *
        (selections of e in b), P_be = mean of p over b; averaged over the sequences with a
        routed token."""
        E, K = self.num_experts, self.top_k
        slots = (seq.unsqueeze(1) * E + idx.long()).reshape(-1)
        cnt = p.new_zeros(n_seq * E).index_add(0, slots, p.new_ones(slots.shape)).view(n_seq, E)
        P = p.new_zeros((n_seq, E)).index_add(0, seq, p)
        tokens = cnt.sum(1, keepdim=True) / K            # every routed token made K selections
        s2 = tokens.clamp_min(1.0).square()
        per_seq = (cnt * P).sum(-1, keepdim=True) * (E / K) / s2
        used = (tokens > 0).to(p.dtype)
        return self.seq_aux_loss_coef * (per_seq * used).sum() / used.sum().clamp_min(1.0)

    # -- experts ------------------------------------------------------------------------------
    def _experts(self, rows: Tensor, counts: Tensor) -> Tensor:
        """SwiGLU MLPs of the local experts on rows grouped by local expert (counts [E_local])."""
        w_up, w_down, b_up, b_down = _autocast(self.w_up, self.w_down, self.b_up, self.b_down)
        host = _host_sizes(counts, rows, w_up, w_down)
        up = _regen_grouped(counts, rows, w_up, b_up, host)
        act = self._act(up, counts, _regen_grouped, (rows, w_up, b_up))
        return self._add_bias(grouped_mm(act, w_down, counts, host), b_down, counts)

    def _experts_padded(self, rows: Tensor) -> Tensor:
        """[E, C, H] -> [E, C, H]: a batched GEMM, no host sync (capacity mode)."""
        w_up, w_down, b_up, b_down = _autocast(self.w_up, self.w_down, self.b_up, self.b_down)
        up = _regen_padded(None, rows, w_up, b_up)
        act = self._act(up, None, _regen_padded, (rows, w_up, b_up))
        return self._add_bias(torch.bmm(act, w_down), b_down, None)

    def _shared(self, x: Tensor) -> Optional[Tensor]:
        if self.shared_up is None:
            return None
        w_up, w_down = _autocast(self.shared_up, self.shared_down)
        return self._act(_regen_mm(None, x, w_up), None, _regen_mm, (x, w_up)) @ w_down

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        shape = x.shape
        if x.dim() not in (2, 3) or shape[-1] != self.hidden:
            raise ValueError(f"MoE: x: must be [T, {self.hidden}] or [B, S, {self.hidden}] "
                             f"(hidden = {self.hidden}); got shape {list(shape)}")
        if x.dtype != self.gate.dtype and not (x.is_floating_point()
                                               and torch.is_autocast_enabled(x.device.type)):
            # under autocast any floating x, as nn.Linear takes: the router widens it to fp32
            # and the experts cast it to autocast's dtype (L230)
            raise TypeError(f"MoE: x: dtype must be the layer's, {self.gate.dtype} (convert "
                            f"the input, or the layer with .to(dtype)); got {x.dtype}")
        x_all = x.reshape(-1, self.hidden)
        # Sequence of each token (seq_aux_loss): [B, S, H] rows, or one sequence.
        seq = None
        if self.seq_aux_loss_coef > 0 and self.training:
            S = shape[1] if len(shape) == 3 else max(shape[0], 1)
            seq = torch.arange(x_all.shape[0], device=x.device) // S
        rows = None if mask is None else self._routed_rows(mask, shape)
        x = x_all if rows is None else x_all.index_select(0, rows)
        if rows is not None and seq is not None:
            seq = seq.index_select(0, rows)
        T, E, K = x.shape[0], self.num_experts, self.top_k
        if self.routing_replay is None:  # no graph break without a replay
            recomputing, given = _recomputing(), None
        else:
            recomputing, given = self._replayed_ids(T)
        weights, idx, scores = self.route(x, given)
        x, = _autocast(x)  # the experts' operands in autocast's dtype (L230); the router's fp32
        if not recomputing and self.routing_replay is not None:
            self._note_ids(idx)
        self.last_expert_idx = idx.detach()
        if self.capacity_factor is not None:
            cap = max(1, math.ceil(self.capacity_factor * T * K / E))
            ex, row_idx, counts = _mg.moe_init_routing(x, idx, expert_num=E, drop_pad_mode=1,
                                                   expert_capacity=cap)
            out_rows = self._experts_padded(ex)
            mode = 3
        else:
            ex, row_idx, counts = _mg.moe_init_routing(x, idx, expert_num=E)
            if self.ep_group is None:
                out_rows = self._experts(ex, counts)
            else:
                out_rows = self._expert_parallel(ex, counts)
            mode = 2
        # Load statistics: once per token and step (a checkpoint recomputation counts nothing).
        if not recomputing:
            self.last_load = counts.detach()
            if self.training:
                _accumulate_load(self.tokens_per_expert, counts.detach())
        # Scores normalised to sum 1 per token: the P of both score-based losses.
        p = None if scores is None else scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
        self.aux_loss = self._switch_loss(p, counts, T) if p is not None and \
            self.aux_loss_coef > 0 else None
        self.seq_aux_loss = (self._seq_aux_loss(p, idx, seq, int(shape[0]) if len(shape) == 3
                                                else 1) if seq is not None else None)
        y = _mg.moe_finalize_routing(out_rows, row_idx, x1=self._shared(x), scales=weights,
                                 drop_pad_mode=mode, k=K)
        if rows is not None:  # masked tokens: zero output
            y = y.new_zeros((x_all.shape[0], self.hidden)).index_copy(0, rows, y)
        return y.reshape(shape)

    def _switch_loss(self, p: Tensor, counts: Tensor, T: int) -> Tensor:
        """Switch: coef * E * sum_e f_e * P_e (f: fraction of the T*K slots routed to e, no
        gradient; P: mean over tokens of the normalised score). With ep_group both are over the
        tokens of every rank (L88), so the value equals the single-process one on each rank."""
        E, K = self.num_experts, self.top_k
        p_sum = p.sum(0)
        load = torch.cat([counts.to(torch.float64), counts.new_full((1,), T).to(torch.float64)])
        if self.aux_loss_group is not None:
            # Global-batch variant (D35): f over every token of the group, P of this rank's.
            import torch.distributed as dist
            dist.all_reduce(load, group=self.aux_loss_group)
            f = (load[:-1] / (load[-1].clamp_min(1.0) * K)).to(p_sum.dtype)
            return self.aux_loss_coef * E * (f * (p_sum / max(T, 1))).sum()
        if self.ep_group is not None:
            import torch.distributed as dist
            dist.all_reduce(load, group=self.ep_group)
            p_sum = _AllReduceSum.apply(p_sum, self.ep_group)
        tokens = load[-1].clamp_min(1.0)           # a tensor: no host read, no graph break
        f = (load[:-1] / (tokens * K)).to(p_sum.dtype)
        return self.aux_loss_coef * E * (f * (p_sum / tokens.to(p_sum.dtype))).sum()

    # -- expert parallelism -----------------------------------------------------------------
    def _expert_parallel(self, ex: Tensor, counts: Tensor) -> Tensor:
        """Rows sorted by global expert -> owners -> local experts -> back, in the same order."""
        import torch.distributed as dist
        W, El, g = self.ep_size, self.num_local_experts, self.ep_group
        # counts [E] -> per destination rank [W, El]; exchange so each rank learns how many rows
        # of each of its experts every source rank sends.
        send_counts = counts.reshape(W, El).contiguous()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=g)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        recv = all_to_all(ex, out_splits, in_splits, g)        # [sum recv, H], by source rank
        # Received rows are grouped by (source rank, local expert): regroup by local expert with
        # a second, K = 1 permutation (stable, so the source order is kept within an expert).
        local_ids = torch.repeat_interleave(
            torch.arange(El, device=ex.device).repeat(W), recv_counts.reshape(-1))
        rows, idx2, counts2 = _mg.moe_init_routing(recv, local_ids.to(torch.int32).unsqueeze(1),
                                               expert_num=El)
        out = self._experts(rows, counts2)
        back = _mg.moe_finalize_routing(out, idx2, drop_pad_mode=2, k=1)   # receive order again
        return all_to_all(back, in_splits, out_splits, g)      # [T*K, H] in local sorted order

    # -- load balancing ---------------------------------------------------------------------
    @torch.no_grad()
    def update_bias(self):
        """Aux-loss-free balancing (DeepSeek-V3): selection_bias += speed * sign(mean - load)
        with the load counted since the last call (summed over ep_group); resets the count."""
        load = self.tokens_per_expert.clone()
        if self.ep_group is not None:
            import torch.distributed as dist
            dist.all_reduce(load, group=self.ep_group)
        if self.bias_update_speed > 0 and self.score == "sigmoid":
            self.selection_bias += self.bias_update_speed * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, score={self.score!r}, "
                f"n_group={self.n_group}, topk_group={self.topk_group}, "
                f"local_experts={self.num_local_experts}, shared={self.shared_hidden}")


# ----------------------------------------------------------------------- data parallel help --
def expert_parameters(module: nn.Module):
    """Parameters that live on one expert-parallel rank only (MoE.w_up / w_down)."""
    return [p for p in module.parameters() if getattr(p, "_moegrad_expert", False)]


def non_expert_parameters(module: nn.Module):
    return [p for p in module.parameters() if not getattr(p, "_moegrad_expert", False)]


@torch.no_grad()
def all_reduce_non_expert_grads(module: nn.Module, group=None, op: str = "sum"):
    """Data-parallel gradients of the non-expert parameters: all-reduce (sum, or mean) over
    `group`. Expert gradients already hold every rank's tokens (the all-to-all backward), so
    they are left alone. With a loss normalised by the GLOBAL token count, "sum" reproduces the
    single-process gradients exactly (up to summation order)."""
    import torch.distributed as dist
    grads = [p.grad for p in non_expert_parameters(module) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if op == "mean":
        flat /= dist.get_world_size(group)
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n
