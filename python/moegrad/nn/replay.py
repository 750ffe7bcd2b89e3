"""Routing replay for moegrad.nn.MoE (docs/layer.md "Routing replay", decisions.md D34, L185).

RoutingReplay(model) attaches to every MoE layer of a model. Under ``record()`` each layer
forward appends its expert ids [T, K] to ``ids`` in call order; under ``replay()`` the layer
forwards take their ids from that list in the same order and compute the weights with
moegrad.moe_gating_replay, so the experts are exactly the recorded ones and the router still
gets its gradient. A forward that activation checkpointing recomputes during backward reuses the
ids of the forward it recomputes (it neither records nor consumes an entry), so it never
re-selects. Running out of recorded ids, or ids of the wrong shape, raises; a replay never
falls back to selection.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["RoutingReplay"]


class RoutingReplay:
    """Records and replays the expert choices of every moegrad.nn.MoE in ``model``.

    ids: the recorded [T, K] int32 tensors, one per layer forward, in call order (CPU). They can
    be saved (``torch.save(replay.ids, path)``) and set from elsewhere (a rollout engine's
    choices, one [T, K] integer tensor per layer call) with ``load(ids)`` or ``replay(ids)``.
    """

    def __init__(self, model: torch.nn.Module):
        from .moe import MoE
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        if not self.layers:
            raise ValueError("RoutingReplay: model: must contain a moegrad.nn.MoE layer; got "
                             f"{type(model).__name__} without one")
        for m in self.layers:
            m.routing_replay = self
        self.mode = "off"
        self.ids: List[Tensor] = []
        self._pos = 0

    # -- the two phases ----------------------------------------------------------------------
    @contextlib.contextmanager
    def record(self) -> Iterator["RoutingReplay"]:
        """Every layer forward inside appends its ids (earlier recordings are dropped)."""
        self.ids = []
        with self._phase("record"):
            yield self

    @contextlib.contextmanager
    def replay(self, ids: Optional[Sequence[Tensor]] = None) -> Iterator["RoutingReplay"]:
        """Every layer forward inside uses the next recorded ids (or `ids`, loaded first).
        Run the backward inside too when the model uses activation checkpointing."""
        if ids is not None:
            self.load(ids)
        self._pos = 0
        with self._phase("replay"):
            yield self

    def load(self, ids: Sequence[Tensor]) -> None:
        """Sets the ids to replay: one [T, K] integer tensor per layer forward, in call order."""
        loaded = []
        for i, t in enumerate(ids):
            if not isinstance(t, Tensor) or t.dim() != 2 or t.is_floating_point():
                raise ValueError(f"RoutingReplay: ids[{i}]: must be a [T, K] integer tensor; got "
                                 f"{type(t).__name__} {getattr(t, 'shape', '')} "
                                 f"{getattr(t, 'dtype', '')}")
            loaded.append(t.detach().to("cpu", torch.int32))
        self.ids = loaded

    def state_dict(self) -> dict:
        return {"ids": list(self.ids)}

    def load_state_dict(self, state: dict) -> None:
        self.load(state["ids"])

    def detach(self) -> None:
        """Removes the replay from its layers."""
        for m in self.layers:
            if m.routing_replay is self:
                m.routing_replay = None

    # -- called by MoE ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _phase(self, mode: str):
        if self.mode != "off":
            raise RuntimeError(f"RoutingReplay: {mode}: already inside {self.mode}()")
        self.mode = mode
        try:
            yield
        finally:
            self.mode = "off"
            for m in self.layers:
                m._recompute_ids.clear()

    def _next(self, layer, T: int, K: int) -> Tensor:
        """The ids of the next layer forward in replay mode."""
        n = self._pos
        if n >= len(self.ids):
            raise RuntimeError(
                f"RoutingReplay: replay: layer forward #{n} has no recorded ids ({len(self.ids)} "
                "recorded); a replay never selects experts anew")
        t = self.ids[n]
        if tuple(t.shape) != (T, K):
            raise ValueError(f"RoutingReplay: ids[{n}]: must have the shape [T, K] = [{T}, {K}] "
                             f"of layer forward #{n}; got {list(t.shape)}")
        if T and (int(t.min()) < 0 or int(t.max()) >= layer.num_experts):
            raise ValueError(f"RoutingReplay: ids[{n}]: values must lie in [0, "
                             f"{layer.num_experts}); got [{int(t.min())}, {int(t.max())}]")
        self._pos = n + 1
        return t

    def _push(self, ids: Tensor) -> None:
        self.ids.append(ids.detach().to("cpu", torch.int32))
