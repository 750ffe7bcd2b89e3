"""moegrad.nn: the MoE layer on moegrad's fused operators (docs/layer.md).

moe: the layer (MoE), its expert GEMM (grouped_mm), the expert-parallel exchange (all_to_all)
and the parameter helpers of expert parallelism.
"""
from .moe import (MoE, all_reduce_non_expert_grads, all_to_all, expert_parameters,  # noqa: F401
                  grouped_mm, non_expert_parameters)

__all__ = ["MoE", "grouped_mm", "all_to_all", "expert_parameters", "non_expert_parameters",
           "all_reduce_non_expert_grads"]
