"""moegrad as a Hugging Face transformers backend (docs/hf.md; docs/decisions.md D37, L190-L197).

Importing this module registers the experts implementation "moegrad" with transformers'
``ExpertsInterface``, so that ``from_pretrained(..., experts_implementation="moegrad")`` or
``model.set_experts_implementation("moegrad")`` runs every experts module it can serve on
moegrad's operators:

    moe_init_routing -> grouped GEMM (gate_up, + bias) -> swiglu_group or clipped_swiglu
    -> grouped GEMM (down) -> moe_finalize_routing (+ down bias, scales = top_k_weights)

``apply(model)`` also replaces the routers whose math moe_gating_top_k computes exactly, runs
the MoE blocks' SiLU-gated shared experts on swiglu_group (L226), and returns a
:class:`Report` of what it patched and what it left alone (with the reason);
``revert(model)`` (or ``report.revert()``) restores the original modules. A module that does not
map keeps its own code: nothing is ever computed differently from the unpatched model beyond
floating-point rounding.

Needs transformers >= 5 (``pip install moegrad[hf]``).
"""
from __future__ import annotations

import inspect
import math
import struct
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

try:
    from transformers.integrations import moe as _tf_moe
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
except ImportError as _e:  # pragma: no cover - exercised by a test with transformers hidden
    raise ImportError(
        "moegrad.hf needs Hugging Face transformers >= 5 (its ExpertsInterface): "
        "install it with `pip install moegrad[hf]`") from _e

import moegrad as _mg
from moegrad._errors import ERR_PARAM_INVALID, MoeError
from moegrad.nn import grouped_mm
from moegrad.nn.moe import _host_sizes, _over_up_ok, _SwigluOverUp, _transforms_active

__all__ = ["IMPLEMENTATION", "Report", "Entry", "apply", "revert", "experts_forward"]

IMPLEMENTATION = "moegrad"  # the experts_implementation name registered on import

# The argument of moe_gating_top_k that turns renormalisation off for sigmoid / sqrt-softplus
# scores; routers that need it are left alone where this build lacks it.
_NO_RENORM = "no_renorm"


def _has_no_renorm() -> bool:
    try:
        return _NO_RENORM in inspect.signature(_mg.moe_gating_top_k).parameters
    except (TypeError, ValueError):
        return False


def _err(arg: str, rule: str, got) -> MoeError:
    return MoeError(f"moegrad.hf experts: {arg}: {rule}; got {got}", ERR_PARAM_INVALID)


# ------------------------------------------------------------------------------ experts ----
@dataclass(frozen=True)
class _ExpertsPlan:
    """How one experts module runs on moegrad: activation "swiglu" (SiLU gate, first half;
    clamp -1 = none) or "clipped_swiglu" (GPT-OSS: interleaved, alpha, limit, up + 1)."""
    activation: str
    clamp: float = -1.0
    alpha: float = 0.0
    limit: float = 0.0

    def describe(self) -> str:
        if self.activation == "clipped_swiglu":
            return f"clipped_swiglu (interleaved, alpha={self.alpha:g}, limit={self.limit:g})"
        return "swiglu_group" + (f" (clamp {self.clamp:g})" if self.clamp > 0 else "")


def _source(fn) -> Optional[str]:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation
    return type(act) in (SiLUActivation, nn.SiLU)


def _gate_kind(cls) -> Tuple[Optional[str], str]:
    """Which known gate function the experts class uses: "default" (act(gate) * up over the
    two halves), "clamped" (DeepSeek-V4: gate <= limit, |up| <= limit, SiLU), "gpt_oss", or
    None with the reason. Recognised by identity, or by identical source for copies."""
    fn = getattr(cls, "_apply_gate", None)
    if fn is None or fn is getattr(_tf_moe, "_default_apply_gate", None):
        return "default", ""
    src = _source(fn)
    for kind, (module, qualname) in _KNOWN_GATES.items():
        ref = _reference(module, qualname)
        if ref is not None and (fn is ref or (src is not None and src == _source(ref))):
            return kind, ""
    return None, (f"its gate function {cls.__qualname__}._apply_gate is not one moegrad "
                  f"computes")


_KNOWN_GATES = {
    "clamped": ("transformers.models.deepseek_v4.modeling_deepseek_v4",
                "DeepseekV4Experts._apply_gate"),
    "gpt_oss": ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts._apply_gate"),
}


def _reference(module: str, qualname: str):
    """A function or class of transformers by module path and qualified name (None if this
    transformers has no such thing)."""
    import importlib
    try:
        obj = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a missing or broken optional model module
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _plan_experts(m: nn.Module) -> Tuple[Optional[_ExpertsPlan], str]:
    """(_ExpertsPlan, "") when moegrad computes this experts module exactly, else (None,
    reason)."""
    if not getattr(m, "has_gate", True):
        return None, "ungated experts (up_proj then an activation) have no moegrad activation"
    if getattr(m, "has_post_expert_norm", False):
        return None, "a norm after each expert has no counterpart in moegrad"
    up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not isinstance(up, Tensor) or not isinstance(down, Tensor) or up.dim() != 3 \
            or down.dim() != 3:
        return None, "no stacked gate_up_proj / down_proj weights [E, ., .]"
    kind, reason = _gate_kind(type(m))
    if kind is None:
        return None, reason
    concatenated = getattr(m, "is_concatenated", True)
    if kind == "gpt_oss":
        if concatenated:
            return None, "GPT-OSS gate on concatenated halves (moegrad expects interleaved)"
        if getattr(_mg, "clipped_swiglu", None) is None:
            return None, "the GPT-OSS clamped SwiGLU needs moegrad.clipped_swiglu (not in this build)"
        alpha, limit = float(m.alpha), float(m.limit)
        if not (math.isfinite(alpha) and math.isfinite(limit) and limit > 0):
            return None, f"GPT-OSS alpha/limit out of range (alpha={alpha}, limit={limit})"
        return _ExpertsPlan("clipped_swiglu", alpha=alpha, limit=limit), ""
    if not concatenated:
        return None, "interleaved gate/up halves with a SiLU gate do not map"
    act = getattr(m, "act_fn", None)
    if not _is_silu(act):
        return None, f"activation {type(act).__name__} is not SiLU (swiglu_group computes SiLU)"
    if kind == "clamped" and getattr(m, "limit", None) is not None:
        limit, reason = _clamp_limit(m.limit)
        return (_ExpertsPlan("swiglu", clamp=limit), "") if limit is not None else (None, reason)
    return _ExpertsPlan("swiglu"), ""


def _clamp_limit(limit) -> Tuple[Optional[float], str]:
    """(limit as a float, "") for a positive finite clamp limit, else (None, reason)."""
    try:
        value = float(limit)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        return None, f"clamp limit {limit} is not a positive finite number"
    return value, ""


def _check_inputs(m: nn.Module, x: Tensor, idx: Tensor, w: Tensor) -> None:
    """Mixed dtypes or devices fail here, naming the argument (transformers' own message would
    come from deep inside a matmul)."""
    if x.dim() != 2:
        raise _err("hidden_states", "must be 2-D [N, H]", list(x.shape))
    if idx.dim() != 2 or idx.shape[0] != x.shape[0]:
        raise _err("top_k_index", f"must be [N, K] with N = {x.shape[0]}", list(idx.shape))
    if w.shape != idx.shape:
        raise _err("top_k_weights", f"must have top_k_index's shape {list(idx.shape)}",
                   list(w.shape))
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        t = getattr(m, name, None)
        if not isinstance(t, Tensor) or (name.endswith("bias") and not m.has_bias):
            continue
        if t.device != x.device:
            raise _err(name, f"must be on hidden_states' device ({x.device})", t.device)
        if t.dtype != x.dtype:
            raise _err(name, f"dtype must be hidden_states' ({x.dtype})", t.dtype)
    for name, t in (("top_k_index", idx), ("top_k_weights", w)):
        if t.device != x.device:
            raise _err(name, f"must be on hidden_states' device ({x.device})", t.device)


def _weight(m: nn.Module, name: str) -> Tensor:
    """The module's stacked weight as [E, in, out] for grouped_mm: itself when transposed,
    else its transpose VIEW (no copy; grouped_mm reads column-major experts in place)."""
    w = getattr(m, name)
    return w if m.is_transposed else w.transpose(1, 2)


def _expert_gemm(rows: Tensor, w: Tensor, counts: Tensor, host, bias) -> Tensor:
    """rows grouped by expert times w [E, in, out] (+ bias). Eager CPU without bias: torch's
    grouped GEMM (F.grouped_mm; one call, several times faster than per-expert calls at these
    row counts, docs/hf.md); otherwise, and under torch.compile (where torch's CPU
    grouped GEMM does not trace for fp32), moegrad.nn.grouped_mm. The counts cover every row
    but the off-rank ones of expert parallelism, which sit at the end and which no later step
    reads (swiglu_group zeroes them, finalize routing and the init-routing grad skip them)."""
    if (bias is None and rows.device.type == "cpu" and _TORCH_GROUPED_MM is not None
            and not torch.compiler.is_compiling()):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return _TORCH_GROUPED_MM(rows, w, offs=offs)
    return grouped_mm(rows, w, counts, host, bias=bias)


_TORCH_GROUPED_MM = getattr(F, "grouped_mm", None)


def _run_experts(m: nn.Module, plan: _ExpertsPlan, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        # as transformers' default grouped_mm backend: under autocast the experts run in their
        # weights' dtype, the input cast to it and the output back (L230)
        x = x.to(m.gate_up_proj.dtype)
    _check_inputs(m, x, idx, w)
    E, K = m.num_experts, idx.shape[1]
    has_bias = bool(getattr(m, "has_bias", False))
    if getattr(m, "_is_expert_parallel", False):
        # transformers' expert parallelism: the ids are this rank's local ones, and id E (its
        # num_experts) marks a route to another rank's expert. Those slots fall outside the
        # active window [0, E): no row, index -1, no contribution, no gradient (L221).
        if idx.device.type == "cpu" and idx.numel() and int(idx.min()) < 0:
            raise _err("top_k_index", "expert ids must be >= 0", int(idx.min()))
        off_rank = idx >= E
        idx = idx.clamp(max=E)
        w = w.masked_fill(off_rank, 0.0)
        rows, row_idx, counts = _mg.moe_init_routing(x, idx, expert_num=E + 1,
                                                     active_expert_range=[0, E])
        if has_bias:
            idx = idx.clamp(max=E - 1)  # an in-range bias row for a slot whose scale is 0
    else:
        rows, row_idx, counts = _mg.moe_init_routing(x, idx, expert_num=E)
    w_up, w_down = _weight(m, "gate_up_proj"), _weight(m, "down_proj")
    host = _host_sizes(counts, rows, w_up, w_down, bias=has_bias)
    b_up = m.gate_up_proj_bias if has_bias else None
    up = _regen_up(counts, rows, w_up, b_up, host)
    if plan.activation == "clipped_swiglu":
        act = _mg.clipped_swiglu(up, counts, alpha=plan.alpha, limit=plan.limit, bias=1.0,
                                 interleaved=True)
    elif _over_up_ok(up):
        act = _SwigluOverUp.apply(up, counts, plan.clamp, _inclusive(plan.clamp), _regen_up,
                                  (rows, w_up, b_up))
    elif plan.clamp > 0:  # the operator's gradient, at the torch.clamp limit (L227)
        act = _SwigluOverUp.apply(up, counts, plan.clamp, _inclusive(plan.clamp), None, ())
    else:
        act = _mg.swiglu_group(up, group_index=counts)
    out = _expert_gemm(act, w_down, counts, host, None)
    if has_bias:
        y = _mg.moe_finalize_routing(out, row_idx, bias=m.down_proj_bias, scales=w,
                                     expert_idx=idx.to(torch.int32), drop_pad_mode=2, k=K)
    else:
        y = _mg.moe_finalize_routing(out, row_idx, scales=w, drop_pad_mode=2, k=K)
    return y if y.dtype == dtype else y.to(dtype)


def _inclusive(limit: float) -> float:
    """The float32 just above float32(limit) for a clamp limit > 0; a limit <= 0 (no clamp) as
    given. swiglu_group's backward masks the gradient of a clamped value strictly (D11: none at
    exactly the limit); transformers' clamps are torch.clamp, whose gradient passes at the
    limit. A strict mask at this bound is torch's inclusive one at the limit, for float32 values
    and anything narrower (L227)."""
    if limit <= 0:
        return limit
    bits = struct.unpack("<I", struct.pack("<f", limit))[0]
    return struct.unpack("<f", struct.pack("<I", bits + 1))[0]


def _regen_up(counts: Tensor, rows: Tensor, w: Tensor, bias: Optional[Tensor],
              host: Optional[Tensor] = None) -> Tensor:
    """The up GEMM: the forward's, and again for a second backward through the same graph
    (L228), so that the recomputed rows are the forward's by construction."""
    return _expert_gemm(rows, w, counts, host, bias)


def _own_forward(m: nn.Module) -> Callable:
    """The module's own (eager) forward under transformers' dispatch wrapper."""
    fwd = type(m).forward
    return getattr(fwd, "__wrapped__", fwd)


def experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor:
    """The "moegrad" experts implementation: hidden_states [N, H], top_k_index [N, K] (int64 or
    int32), top_k_weights [N, K] (any float dtype; its gradient flows) -> [N, H] in
    hidden_states' dtype. A module moegrad does not compute exactly runs its previous
    implementation (after apply) or its own eager forward. Errors: MoeError (161002) for mixed
    dtypes or devices, naming the argument."""
    plan = getattr(self, "_moegrad_plan", None)
    if plan is None:
        plan, reason = _plan_experts(self)
        if not torch.compiler.is_compiling():
            self._moegrad_plan = plan if plan is not None else reason
            if plan is None:
                warnings.warn(f"moegrad.hf: {type(self).__name__} keeps its own code: {reason}",
                              stacklevel=2)
    if isinstance(plan, _ExpertsPlan):
        return _run_experts(self, plan, hidden_states, top_k_index, top_k_weights)
    fallback = getattr(self, "_moegrad_fallback", None)
    if fallback not in (None, "eager", IMPLEMENTATION) and fallback in ALL_EXPERTS_FUNCTIONS:
        return ALL_EXPERTS_FUNCTIONS[fallback](self, hidden_states, top_k_index, top_k_weights)
    return _own_forward(self)(self, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, experts_forward)


# ------------------------------------------------------------------------------- routers ----
# Each router forward returns what the original returns: (router_logits unchanged — the tensor
# output_router_logits records and the load-balancing loss reads —, weights, int64 ids).
def _topk(logits: Tensor, k: int, **kw) -> Tuple[Tensor, Tensor]:
    y, idx, _ = _mg.moe_gating_top_k(logits, k, **kw)
    return y, idx.long()


def _softmax_router(self, hidden_states):
    """Qwen2-MoE / Qwen3-MoE / OLMoE: fp32 softmax, top-k, optional renormalisation, weights in
    the logits' dtype. Renormalised top-k softmax = softmax over the k logits (renorm=1)."""
    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(h, self.weight)
    y, idx = _topk(logits.float(), self.top_k, renorm=1 if self.norm_topk_prob else 0,
                   norm_type=0)
    return logits, y.to(logits.dtype), idx


def _mixtral_router(self, hidden_states):
    """Mixtral: softmax over the k logits, weights kept in fp32."""
    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(h, self.weight)
    y, idx = _topk(logits.float(), self.top_k, renorm=1, norm_type=0)
    return logits, y, idx


def _gpt_oss_router(self, hidden_states):
    """GPT-OSS: top-k of the logits (with bias), softmax over the k in the logits' dtype."""
    logits = F.linear(hidden_states, self.weight, self.bias)
    y, idx = _topk(logits, self.top_k, renorm=1, norm_type=0)
    return logits, y, idx


def _renorm_kw(norm_topk_prob: bool) -> dict:
    return {} if norm_topk_prob else {_NO_RENORM: True}


def _deepseek_v3_router(self, hidden_states):
    """DeepSeek-V3: fp32 sigmoid scores, selection bias, group-limited selection (groups ranked
    by the sum of their top two), renormalisation (sum + 1e-20) and routed scaling."""
    h = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(h.type(torch.float32), self.weight.type(torch.float32))
    # under autocast the linear returns bf16/fp16 logits, and the weights go back in that dtype
    # as transformers' do; the fp32 bias needs fp32 scores here (L230)
    y, idx = _topk(logits.float(), self.top_k, bias=self.e_score_correction_bias.float(),
                   k_group=self.topk_group, group_count=self.num_group, group_select_mode=1,
                   norm_type=1, routed_scaling_factor=float(self.routed_scaling_factor),
                   eps=1e-20, **_renorm_kw(self.norm_topk_prob))
    return logits, y.to(logits.dtype), idx


def _deepseek_v4_router(self, hidden_states):
    """DeepSeek-V4: sqrt(softplus) (or sigmoid) scores, selection bias, renormalisation (sum +
    1e-20), routed scaling; weights in the logits' dtype."""
    flat = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(flat, self.weight)
    y, idx = _topk(logits.float(), self.top_k, bias=self.e_score_correction_bias.float(),
                   norm_type=self._moegrad_norm_type,
                   routed_scaling_factor=float(self.routed_scaling_factor), eps=1e-20)
    return logits, y.to(logits.dtype), idx


# family -> (reference router class, patched forward). A router maps when its class is the
# reference or a copy of it (identical forward source; transformers copies routers between
# models), and `_router_check` accepts its attributes.
_ROUTERS = {
    "softmax": (("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"),
                _softmax_router),
    "softmax-qwen2": (("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter"),
                      _softmax_router),
    "softmax-olmoe": (("transformers.models.olmoe.modeling_olmoe", "OlmoeTopKRouter"),
                      _softmax_router),
    "mixtral": (("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter"),
                _mixtral_router),
    "gpt_oss": (("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter"),
                _gpt_oss_router),
    "deepseek_v3": (("transformers.models.deepseek_v3.modeling_deepseek_v3",
                     "DeepseekV3TopkRouter"), _deepseek_v3_router),
    "deepseek_v4": (("transformers.models.deepseek_v4.modeling_deepseek_v4",
                     "DeepseekV4TopKRouter"), _deepseek_v4_router),
}
_HASH_ROUTERS = (("transformers.models.deepseek_v4.modeling_deepseek_v4",
                  "DeepseekV4HashRouter"),)
_family_cache: Dict[type, Optional[str]] = {}


def _router_family(cls) -> Optional[str]:
    if cls in _family_cache:
        return _family_cache[cls]
    found = None
    src = _source(cls.forward)
    for family, (ref, _fwd) in _ROUTERS.items():
        ref_cls = _reference(*ref)
        if ref_cls is None:
            continue
        if cls is ref_cls or (src is not None and src == _source(ref_cls.forward)):
            found = family
            break
    _family_cache[cls] = found
    return found


def _is_hash_router(cls) -> bool:
    return any(cls is _reference(*ref) for ref in _HASH_ROUTERS)


def _router_check(family: str, r: nn.Module) -> str:
    """"" when the router's attributes map, else the reason."""
    if family == "deepseek_v3":
        E, G, kg, k = r.num_experts, int(r.num_group), int(r.topk_group), int(r.top_k)
        if G < 1 or E % G or not 1 <= kg <= G:
            return f"groups do not divide the experts (E={E}, n_group={G}, topk_group={kg})"
        if E // G < 2 and G > 1:
            return "groups of one expert (the group score sums each group's top two)"
        if k > kg * (E // G):
            return f"top_k {k} exceeds the experts of the {kg} kept groups"
        if not r.norm_topk_prob and not _has_no_renorm():
            return ("sigmoid top-k without renormalisation (norm_topk_prob=False) needs "
                    "moe_gating_top_k's no_renorm switch (not in this build)")
    if family == "deepseek_v4":
        from transformers.activations import SqrtSoftplusActivation
        kind = type(r.score_fn)
        if kind is SqrtSoftplusActivation:
            r._moegrad_norm_type = 2
        elif kind is nn.Sigmoid or getattr(r.score_fn, "__name__", "") == "sigmoid":
            r._moegrad_norm_type = 1
        else:
            return f"scoring function {kind.__name__} has no moegrad norm type"
    return ""


_patched_classes: Dict[type, type] = {}


def _patched_class(cls, forward, what: str = "routed by moegrad.moe_gating_top_k") -> type:
    """A subclass of the module's class (a router's, a shared expert's) with moegrad's forward:
    isinstance checks (transformers' router-logit recorder) still match, parameters and hooks
    stay on the same module."""
    if cls not in _patched_classes:
        _patched_classes[cls] = type(cls.__name__, (cls,), {
            "forward": forward, "_moegrad_original_class": cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__name__} {what} (moegrad.hf)."})
    return _patched_classes[cls]


# ------------------------------------------------------------------------- shared experts ----
# A MoE block's shared expert (Qwen2-MoE's shared_expert, DeepSeek-V3/V4's shared_experts) is a
# gated MLP, down(silu(gate(x)) * up(x)), DeepSeek-V4's with gate <= limit and |up| <= limit.
# Patched, its two input projections write the two halves of one [T, 2I] buffer, swiglu_group
# computes the activation in one pass and its gradient in another, and one addmm returns the
# input gradient of both projections: four elementwise passes, a gradient sum and one saved
# [T, I] activation fewer (L226).
class _GatedMLP(torch.autograd.Function):
    """x [..., H], gate / up weights [I, H], down weight [H, I] (one dtype, no biases), clamp
    limit (-1 = none) -> down(swiglu(x @ [gate; up]^T)) [..., H]."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, clamp):
        x2 = x.reshape(-1, x.shape[-1])
        inter = w_gate.shape[0]
        if torch.compiler.is_compiling():
            # dynamo does not capture out= into a view; the compiler places the cat itself
            gate_up = torch.cat((torch.mm(x2, w_gate.t()), torch.mm(x2, w_up.t())), 1)
        else:
            gate_up = x2.new_empty(x2.shape[0], 2 * inter)
            torch.mm(x2, w_gate.t(), out=gate_up[:, :inter])
            torch.mm(x2, w_up.t(), out=gate_up[:, inter:])
        act = _mg.swiglu_group(gate_up, clamp_limit=clamp)
        # act is only needed for the down projection's weight gradient
        ctx.save_for_backward(x2, w_gate, w_up, w_down, gate_up,
                              act if ctx.needs_input_grad[3] else None)
        ctx.clamp, ctx.x_shape = clamp, x.shape
        return torch.mm(act, w_down.t()).view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x2, w_gate, w_up, w_down, gate_up, act = ctx.saved_tensors
        need_x, need_gate, need_up, need_down, _ = ctx.needs_input_grad
        inter = w_gate.shape[0]
        gy = grad_y.reshape(-1, grad_y.shape[-1])
        grad_down = torch.mm(gy.t(), act) if need_down else None
        grad_x = grad_gate = grad_up = None
        if need_x or need_gate or need_up:
            grad_gu, _ = _mg.swiglu_group_quant_backward(torch.mm(gy, w_down), gate_up,
                                                         clamp_limit=_inclusive(ctx.clamp))
            g_gate, g_up = grad_gu[:, :inter], grad_gu[:, inter:]
            if need_x:
                grad_x = torch.addmm(torch.mm(g_gate, w_gate), g_up, w_up).view(ctx.x_shape)
            if need_gate:
                grad_gate = torch.mm(g_gate.t(), x2)
            if need_up:
                grad_up = torch.mm(g_up.t(), x2)
        return grad_x, grad_gate, grad_up, grad_down, None


_SHARED_MLPS = {
    "gated": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeMLP"),
    "clamped": ("transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4MLP"),
}
_SHARED_NAMES = ("shared_expert", "shared_experts")


def _shared_kind(cls) -> Optional[str]:
    """"gated" / "clamped" when cls is, or copies the forward of, a known shared-expert MLP
    (transformers copies it between models: DeepSeek-V3's is Qwen2-MoE's)."""
    src = _source(cls.forward)
    for kind, ref in _SHARED_MLPS.items():
        ref_cls = _reference(*ref)
        if ref_cls is not None and (cls is ref_cls or (src is not None
                                                       and src == _source(ref_cls.forward))):
            return kind
    return None


def _shared_limit(m: nn.Module, kind: str) -> Tuple[Optional[float], str]:
    """(clamp limit, -1.0 for none; "") of a shared expert of this kind, else (None, reason)."""
    return (-1.0, "") if kind == "gated" else _clamp_limit(getattr(m, "limit", None))


def _shared_plan(m: nn.Module) -> Tuple[Optional[str], str]:
    """(kind, "") when the shared expert maps, else (None, reason)."""
    kind = _shared_kind(type(m))
    if kind is None:
        return None, "its MLP forward is not one moegrad computes (down(silu(gate) * up))"
    if not _is_silu(getattr(m, "act_fn", None)):
        return None, (f"activation {type(getattr(m, 'act_fn', None)).__name__} is not SiLU "
                      f"(swiglu_group computes SiLU)")
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(m, name, None)
        if type(lin) is not nn.Linear:
            return None, f"{name} is {type(lin).__name__}, not a plain nn.Linear"
        if lin.bias is not None:
            return None, f"{name} has a bias (moegrad's fused shared expert has none)"
    limit, reason = _shared_limit(m, kind)
    return (kind, "") if limit is not None else (None, reason)


def _unhooked(m: nn.Module) -> bool:
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks)


def _plain(lin: nn.Module) -> bool:
    """A bias-free nn.Linear (not a subclass) with a plain weight (not a tensor subclass: a
    quantised or sharded one) and no hooks."""
    return (type(lin) is nn.Linear and lin.bias is None and _unhooked(lin)
            and type(lin.weight) in (nn.Parameter, Tensor))


def _global_hooks() -> bool:
    mod = nn.modules.module
    return bool(mod._global_forward_hooks or mod._global_forward_pre_hooks
                or mod._global_backward_hooks or mod._global_backward_pre_hooks)


def _shared_forward(self, x):
    """moegrad's forward of a shared expert, x [..., H] -> [..., H]. Whatever the fused path
    would not compute exactly runs the module's own forward: autocast, a projection or the
    activation replaced or hooked (forward or backward) since apply (an adapter such as LoRA, a
    quantised or sharded weight, a parametrisation), an invalid clamp limit, global module
    hooks, torch.func transforms and forward-mode AD.
    Errors: MoeError (161002) for a weight of another dtype or device than x, naming it."""
    g, u, d = self.gate_proj, self.up_proj, self.down_proj
    own = self._moegrad_original_class.forward
    act = getattr(self, "act_fn", None)
    clamp, _ = _shared_limit(self, self._moegrad_kind)
    if (clamp is None or torch.is_autocast_enabled(x.device.type)
            or not (_plain(g) and _plain(u) and _plain(d)) or not _is_silu(act)
            or not _unhooked(act) or _global_hooks() or _transforms_active()):
        return own(self, x)
    ws = (g.weight, u.weight, d.weight)
    for name, w in zip(("gate_proj", "up_proj", "down_proj"), ws):
        if w.device != x.device:
            raise MoeError(f"moegrad.hf shared expert: {name}.weight: must be on the input's "
                           f"device ({x.device}); got {w.device}", ERR_PARAM_INVALID)
        if w.dtype != x.dtype:
            raise MoeError(f"moegrad.hf shared expert: {name}.weight: dtype must be the "
                           f"input's ({x.dtype}); got {w.dtype}", ERR_PARAM_INVALID)
    if x.shape[-1] != ws[0].shape[1]:
        return own(self, x)  # torch's own shape error
    return _GatedMLP.apply(x, *ws, clamp)


def _shared_modules(model: nn.Module, blocks: List[str]):
    """(name, module) of the shared experts of the MoE blocks (a child named shared_expert(s)
    of a module that holds an experts module); dense MLPs elsewhere are not touched."""
    for block in blocks:
        parent = model.get_submodule(block) if block else model
        for child in _SHARED_NAMES:
            m = getattr(parent, child, None)
            if isinstance(m, nn.Module):
                yield (f"{block}.{child}" if block else child), m


def _seen(name: str, m: nn.Module, kind: str, report: Report) -> Tuple[str, bool]:
    """(the module's own class name, whether an earlier apply already patched its class: then it
    is reported as such)."""
    original = getattr(type(m), "_moegrad_original_class", None)
    cls = (original or type(m)).__name__
    if original is not None:
        report.patched.append(Entry(name, kind, cls, "already patched"))
    return cls, original is not None


def _apply_shared(shared, state, report: Report) -> None:
    for name, m in shared:
        cls, done = _seen(name, m, "shared", report)
        if done:
            continue
        kind, reason = _shared_plan(m)
        if kind is None:
            report.left_alone.append(Entry(name, "shared", cls, reason))
            continue
        clamp = _shared_limit(m, kind)[0]
        m._moegrad_kind = kind
        m.__class__ = _patched_class(type(m), _shared_forward, "run on moegrad.swiglu_group")
        state.setdefault("shared", []).append(m)
        report.patched.append(Entry(name, "shared", cls, "gate/up GEMMs into one buffer, "
                                    "swiglu_group" + (f" (clamp {clamp:g})" if clamp > 0 else "")))


# ------------------------------------------------------------------------------- report -----
@dataclass
class Entry:
    """One module: its qualified name in the model, its kind ("router" / "experts" / "shared"),
    its class, and what moegrad runs for it (patched) or why it keeps its own code (left
    alone)."""
    name: str
    kind: str
    cls: str
    detail: str


@dataclass
class Report:
    """What apply() did. `patched` and `left_alone` list Entry objects; str() is a table;
    revert() undoes the patch (same as moegrad.hf.revert(model))."""
    patched: List[Entry] = field(default_factory=list)
    left_alone: List[Entry] = field(default_factory=list)
    _model: Optional[nn.Module] = field(default=None, repr=False, compare=False)

    def revert(self) -> List[str]:
        if self._model is None:
            return []
        return revert(self._model)

    def __str__(self) -> str:
        lines = [f"moegrad.hf: {len(self.patched)} patched, {len(self.left_alone)} left alone"]
        for title, entries in (("patched", self.patched), ("left alone", self.left_alone)):
            for e in entries:
                lines.append(f"  {title:10s} {e.kind:7s} {e.name} ({e.cls}): {e.detail}")
        return "\n".join(lines)


_STATE = "_moegrad_hf_state"  # on the model: what revert() needs


def _experts_modules(model: nn.Module):
    """(name, module) of every transformers experts module (one the experts dispatch serves)."""
    for name, m in model.named_modules():
        fwd = getattr(type(m), "forward", None)
        if hasattr(m, "is_transposed") and hasattr(m, "down_proj") and hasattr(m, "config") \
                and hasattr(fwd, "__wrapped__"):
            yield name, m


def _router_modules(model: nn.Module, blocks: List[str]):
    """(name, module) of the routers: a known router class anywhere, or a sibling named gate /
    router of an experts module (unknown ones are reported as left alone)."""
    seen = set()
    for name, m in model.named_modules():
        cls = getattr(type(m), "_moegrad_original_class", type(m))
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        sibling = parent in blocks and name.rsplit(".", 1)[-1] in ("gate", "router")
        if _router_family(cls) or _is_hash_router(cls) or sibling:
            if id(m) not in seen:
                seen.add(id(m))
                yield name, m


def apply(model: nn.Module, *, router: bool = True, experts: bool = True) -> Report:
    """Patch a loaded transformers model in place to run its MoE blocks on moegrad.

    router=True: every router whose math moe_gating_top_k computes exactly (softmax top-k with
    or without renormalisation: Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral; GPT-OSS; DeepSeek-V3's
    sigmoid + selection bias + groups + scaling; DeepSeek-V4's sqrt-softplus) gets moegrad's
    forward; router_logits stay the same tensor the model returned before. experts=True: the
    model's experts run the "moegrad" implementation where they map (the others keep the
    implementation they had), and the blocks' shared experts that are SiLU-gated MLPs without
    biases (Qwen2-MoE, DeepSeek-V3, DeepSeek-V4 with its clamp) run their activation on
    swiglu_group. Applying twice is harmless; revert(model) undoes it.

    Returns a Report. Errors: TypeError for a non-module or a non-bool option (unknown
    options are TypeErrors of the signature); ValueError when both options are False or the
    model has no MoE block (nothing is changed then).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"moegrad.hf.apply: model: must be a torch.nn.Module; got "
                        f"{type(model).__name__}")
    for name, v in (("router", router), ("experts", experts)):
        if not isinstance(v, bool):
            raise TypeError(f"moegrad.hf.apply: {name}: must be True or False; got {v!r}")
    if not (router or experts):
        raise ValueError("moegrad.hf.apply: router and experts are both False: nothing to patch")
    experts_list = list(_experts_modules(model))
    blocks = [n.rsplit(".", 1)[0] if "." in n else "" for n, _ in experts_list]
    routers = list(_router_modules(model, blocks))
    if not experts_list and not routers:
        raise ValueError(f"moegrad.hf.apply: model: {type(model).__name__} has no "
                         f"Mixture-of-Experts block (no transformers experts module or "
                         f"router); nothing was changed")
    state = model.__dict__.setdefault(_STATE, {"configs": {}, "experts": [], "routers": []})
    report = Report(_model=model)
    if experts:
        _apply_experts(experts_list, state, report)
        _apply_shared(list(_shared_modules(model, blocks)), state, report)
    if router:
        _apply_routers(routers, state, report)
    return report


def _apply_experts(experts_list, state, report: Report) -> None:
    plans = [(name, m, _plan_experts(m)) for name, m in experts_list]
    mapped = [m for _, m, (plan, _) in plans if plan is not None]
    # The implementation is chosen per config (transformers reads config._experts_implementation
    # in every experts call); switch each config that holds a mapped module.
    for m in mapped:
        cfg = m.config
        if id(cfg) not in state["configs"]:
            state["configs"][id(cfg)] = (cfg, cfg._experts_implementation)
    for name, m, (plan, reason) in plans:
        cfg_prev = state["configs"].get(id(m.config), (None, m.config._experts_implementation))[1]
        if id(m) not in {id(x) for x in state["experts"]}:
            state["experts"].append(m)
        cls = type(m).__name__
        if plan is not None:
            m._moegrad_plan = plan
            report.patched.append(Entry(name, "experts", cls, plan.describe()))
        else:
            m._moegrad_plan = reason
            m._moegrad_fallback = cfg_prev
            report.left_alone.append(Entry(name, "experts", cls, reason))
    for m in mapped:
        m.config._experts_implementation_internal = IMPLEMENTATION


def _apply_routers(routers, state, report: Report) -> None:
    for name, r in routers:
        cls, done = _seen(name, r, "router", report)
        if done:
            continue
        if _is_hash_router(type(r)):
            report.left_alone.append(Entry(name, "router", cls, (
                "hash routing (a fixed token-to-expert table) has no moe_gating_top_k mode")))
            continue
        family = _router_family(type(r))
        if family is None:
            report.left_alone.append(Entry(name, "router", cls,
                                           "router math not recognised as one moegrad maps"))
            continue
        reason = _router_check(family, r)
        if reason:
            report.left_alone.append(Entry(name, "router", cls, reason))
            continue
        r.__class__ = _patched_class(type(r), _ROUTERS[family][1])
        state["routers"].append(r)
        report.patched.append(Entry(name, "router", cls, f"moe_gating_top_k ({family})"))


def revert(model: nn.Module) -> List[str]:
    """Undo apply(): routers and shared experts get their own classes back, configs their
    previous experts implementation, experts modules lose moegrad's per-module state. Returns
    the names of the modules restored ([] for a model apply() never patched)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"moegrad.hf.revert: model: must be a torch.nn.Module; got "
                        f"{type(model).__name__}")
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return []
    names = {id(m): n for n, m in model.named_modules()}
    restored = []
    for r in state["routers"] + state.get("shared", []):
        original = getattr(type(r), "_moegrad_original_class", None)
        if original is not None:
            r.__class__ = original
            r.__dict__.pop("_moegrad_kind", None)
            restored.append(names.get(id(r), type(r).__name__))
    for cfg, prev in state["configs"].values():
        cfg._experts_implementation_internal = prev
    for m in state["experts"]:
        for attr in ("_moegrad_plan", "_moegrad_fallback"):
            m.__dict__.pop(attr, None)
        restored.append(names.get(id(m), type(m).__name__))
    return restored


# ------------------------------------------------------------------ small test models -------
ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss",
                 "deepseek_v4")


def small_config(arch: str, *, hidden: int = 32, intermediate: int = 16, experts: int = 8,
                 top_k: int = 2, layers: int = 2, vocab: int = 64, heads: int = 2,
                 max_positions: int = 256, **overrides):
    """A transformers config of architecture `arch` (one of ARCHITECTURES) with the MoE sizes
    given: hidden H, per-expert intermediate I, E experts, top-k K (what the tests, the demo and
    the benchmark build from; random init, nothing is downloaded). DeepSeek-V3 gets expert
    groups (up to 4 groups of >= 2, half of them kept), one shared expert and a dense first
    layer; Qwen2-MoE a gated shared expert; DeepSeek-V4 hash routing in its first layer.
    `overrides` go to the config class last."""
    import transformers as tf
    head_dim = max(hidden // heads, 8)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
                  max_position_embeddings=max_positions, num_experts_per_tok=top_k)
    if arch == "qwen3_moe":
        cls, kw = tf.Qwen3MoeConfig, dict(moe_intermediate_size=intermediate,
                                          intermediate_size=2 * intermediate, num_experts=experts,
                                          norm_topk_prob=True)
    elif arch == "qwen2_moe":
        cls, kw = tf.Qwen2MoeConfig, dict(moe_intermediate_size=intermediate,
                                          intermediate_size=2 * intermediate,
                                          shared_expert_intermediate_size=2 * intermediate,
                                          num_experts=experts)
    elif arch == "olmoe":
        cls, kw = tf.OlmoeConfig, dict(intermediate_size=intermediate, num_experts=experts)
        common.pop("head_dim")
    elif arch == "mixtral":
        cls, kw = tf.MixtralConfig, dict(intermediate_size=intermediate,
                                         num_local_experts=experts)
    elif arch == "deepseek_v3":
        groups = next(g for g in (4, 2, 1) if experts % g == 0 and experts // g >= 2
                      and top_k <= (max(g // 2, 1)) * (experts // g))
        rope = max(head_dim // 2, 4)
        cls, kw = tf.DeepseekV3Config, dict(
            moe_intermediate_size=intermediate, intermediate_size=2 * intermediate,
            n_routed_experts=experts, n_group=groups, topk_group=max(groups // 2, 1),
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            q_lora_rank=None, kv_lora_rank=max(hidden // 2, 8), qk_rope_head_dim=rope,
            qk_nope_head_dim=rope, v_head_dim=head_dim, head_dim=rope,
            num_key_value_heads=heads)
        common.pop("num_key_value_heads")
        common.pop("head_dim")
        common["num_hidden_layers"] = layers + 1  # the first layer is dense
    elif arch == "gpt_oss":
        cls, kw = tf.GptOssConfig, dict(intermediate_size=intermediate,
                                        num_local_experts=experts, sliding_window=16)
    elif arch == "deepseek_v4":
        cls, kw = tf.DeepseekV4Config, dict(
            moe_intermediate_size=intermediate, n_routed_experts=experts,
            mlp_layer_types=["hash_moe"] + ["moe"] * layers, q_lora_rank=hidden // 2,
            o_groups=heads, o_lora_rank=hidden // 2, index_n_heads=heads, index_head_dim=16,
            index_topk=4, sliding_window=16, hc_mult=2, hc_sinkhorn_iters=4,
            num_nextn_predict_layers=0)
        common["num_hidden_layers"] = layers + 1  # the first layer is hash-routed
    else:
        raise ValueError(f"moegrad.hf.small_config: arch: must be one of {ARCHITECTURES}; "
                         f"got {arch!r}")
    common.update(kw)
    common.update(overrides)
    cfg = cls(**common)
    cfg._attn_implementation = "eager"
    return cfg
