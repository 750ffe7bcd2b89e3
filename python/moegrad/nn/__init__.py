"""moegrad.nn: the MoE layer on moegrad's fused operators (docs/layer.md).

moe: the layer (MoE), its expert GEMM (grouped_mm), the expert-parallel exchange (all_to_all)
and the parameter helpers of expert parallelism. replay: RoutingReplay, record / replay of a
model's expert choices (docs/layer.md "Routing replay").
"""
from .moe import (MoE, all_reduce_non_expert_grads, all_to_all, expert_parameters,  # noqa: F401
                  grouped_mm, non_expert_parameters)
from .replay import RoutingReplay  # noqa: F401

__all__ = ["MoE", "RoutingReplay", "grouped_mm", "all_to_all", "expert_parameters",
           "non_expert_parameters", "all_reduce_non_expert_grads"]
