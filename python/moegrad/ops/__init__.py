"""The moegrad operators, one module per family (vendor-compatible ``moegrad.ops``).

``from moegrad.ops import moe_finalize_routing_grad`` works as the vendor's import does. Each
family module (gating_topk, finalize_routing, swiglu, init_routing) holds the registration,
fake kernel, autograd and public function of its ops; _registry the shared machinery; permute
the moe_permute / moe_unpermute pair over init and finalize routing (docs/layer.md).
Signatures: docs/operators.md §7.2.
"""
from .finalize_routing import moe_finalize_routing, moe_finalize_routing_grad
from .gating_topk import moe_gating_top_k, moe_gating_top_k_backward
from .init_routing import moe_init_routing, moe_init_routing_grad
from .permute import PermuteState, moe_permute, moe_unpermute
from .swiglu import swiglu_group, swiglu_group_quant, swiglu_group_quant_backward

__all__ = [
    "moe_gating_top_k",
    "moe_gating_top_k_backward",
    "moe_finalize_routing",
    "moe_finalize_routing_grad",
    "swiglu_group",
    "swiglu_group_quant_backward",
    "swiglu_group_quant",
    "moe_init_routing",
    "moe_init_routing_grad",
    "moe_permute",
    "moe_unpermute",
    "PermuteState",
]
