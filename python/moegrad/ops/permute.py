"""A permute / unpermute pair that cannot be mixed up (docs/layer.md "Permute and unpermute").

``moe_permute`` runs ``moe_init_routing`` and returns, with the expanded rows, a small immutable
``PermuteState`` that records their layout; ``moe_unpermute`` runs ``moe_finalize_routing`` with
the ``drop_pad_mode`` that layout needs (2 dropless, 3 with a capacity). The operators keep the
vendor's defaults (docs/operators.md §4.4: finalize mode 0 reads the column layout, which
``moe_init_routing`` does not produce); the pair is the safe way to compose them
(docs/decisions.md L170, L171). No new kernel: both functions are plain Python over the two
registered operators, so they are differentiable and trace into one torch.compile graph.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from torch import Tensor

from .._errors import ERR_FINALIZE_ROUTING, ERR_PARAM_INVALID, MoeError
from .finalize_routing import moe_finalize_routing
from .init_routing import moe_init_routing


class PermuteState(NamedTuple):
    """What ``moe_unpermute`` needs to undo ``moe_permute``; returned by it, not built by hand.

    expanded_row_idx: [R*K] int32, slot r*K + k -> its expanded row (row layout, -1 = dropped).
    tokens_per_expert: [E] int64, the slots routed to each expert (before the capacity cut), so
      in dropless mode the row counts of the expert groups of expanded_x, in expert order.
    num_tokens R, top_k K, num_experts E, capacity C (0: dropless).
    """

    expanded_row_idx: Tensor
    tokens_per_expert: Tensor
    num_tokens: int
    top_k: int
    num_experts: int
    capacity: int

    @property
    def drop_pad_mode(self) -> int:
        """The moe_finalize_routing mode of this layout: 2 dropless, 3 drop/pad (§4.4)."""
        return 3 if self.capacity > 0 else 2

    @property
    def expanded_shape(self) -> Tuple[int, ...]:
        """Leading dimensions of expanded_x: (R*K,) dropless, (E, C) with a capacity."""
        if self.capacity > 0:
            return (self.num_experts, self.capacity)
        return (self.num_tokens * self.top_k,)


def _int_at_least(op: str, name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MoeError(f"{op}: {name}: must be an int; got {value!r}", ERR_PARAM_INVALID)
    if value < lo:
        raise MoeError(f"{op}: {name}: must be >= {lo}; got {value}", ERR_PARAM_INVALID)
    return value


def moe_permute(x: Tensor, expert_idx: Tensor, num_experts: int, *,
                capacity: int = 0) -> Tuple[Tensor, PermuteState]:
    """Group token rows by expert for the expert MLPs; undo with ``moe_unpermute``.

    x: [R, H] float32/float16/bfloat16; expert_idx: [R, K] int32 (int64 accepted) expert ids in
    [0, num_experts), e.g. moe_gating_top_k's second output. Returns (expanded_x, state):
    - capacity 0 (dropless): expanded_x [R*K, H], the R*K (token, choice) copies sorted by
      expert, stably (lower token first); expert e's rows are the
      state.tokens_per_expert[e] rows after those of experts 0..e-1.
    - capacity C > 0: expanded_x [E, C, H]; each expert keeps its first C slots in token order,
      the others are dropped (they add nothing in moe_unpermute), unused rows are zero.
    Differentiable w.r.t. x. Runs moe_init_routing (docs/operators.md §8); docs/layer.md
    "Permute and unpermute". Errors: MoeError 161002 (num_experts, capacity, expert_idx rank),
    then moe_init_routing's own (161001/161002, 561103).
    """
    op = "moe_permute"
    _int_at_least(op, "num_experts", num_experts, 1)
    _int_at_least(op, "capacity", capacity, 0)
    if expert_idx.dim() != 2:
        raise MoeError(f"{op}: expert_idx: must be 2-D [R, K]; got shape "
                       f"{list(expert_idx.shape)}", ERR_PARAM_INVALID)
    R, K = expert_idx.shape
    expanded_x, idx, counts = moe_init_routing(
        x, expert_idx, expert_num=num_experts, expert_capacity=capacity,
        drop_pad_mode=1 if capacity > 0 else 0, expert_tokens_num_type=1)
    return expanded_x, PermuteState(idx, counts, R, K, num_experts, capacity)


def moe_unpermute(expert_out: Tensor, state: PermuteState, scales: Optional[Tensor] = None, *,
                  residual: Optional[Tensor] = None) -> Tensor:
    """Combine the expert outputs of ``moe_permute``'s rows back into token order.

    expert_out: shaped like moe_permute's expanded_x ([R*K, H] or [E, C, H]; H may differ from
    x's), any dtype moe_finalize_routing takes; scales: [R, K] (the router weights, slot k of
    token r weighs its k-th choice; None: weight 1); residual: [R, H] added to every token, or
    None. Returns y [R, H] in expert_out's dtype:
        y[r] = residual[r] + sum_k scales[r, k] * expert_out[row of (r, k)]
    (dropped slots contribute nothing). Differentiable w.r.t. expert_out, scales and residual.
    Runs moe_finalize_routing with drop_pad_mode = state.drop_pad_mode (docs/operators.md §4);
    docs/layer.md "Permute and unpermute". Errors: MoeError 161002 (state not from
    moe_permute), 561103 (expert_out or residual shaped unlike the state), then
    moe_finalize_routing's own.
    """
    op = "moe_unpermute"
    if not isinstance(state, PermuteState):
        raise MoeError(f"{op}: state: must be the PermuteState returned by moe_permute; got "
                       f"{type(state).__name__}", ERR_PARAM_INVALID)
    lead = state.expanded_shape
    if expert_out.dim() != len(lead) + 1 or tuple(expert_out.shape[:-1]) != lead:
        raise MoeError(f"{op}: expert_out: must be [{', '.join(map(str, lead))}, H] like "
                       f"moe_permute's expanded_x; got shape {list(expert_out.shape)}",
                       ERR_FINALIZE_ROUTING)
    R, H = state.num_tokens, expert_out.shape[-1]
    if residual is not None and tuple(residual.shape) != (R, H):
        raise MoeError(f"{op}: residual: must be [R, H] = [{R}, {H}]; got shape "
                       f"{list(residual.shape)}", ERR_FINALIZE_ROUTING)
    return moe_finalize_routing(expert_out, state.expanded_row_idx, x1=residual, scales=scales,
                                drop_pad_mode=state.drop_pad_mode, k=state.top_k)
