"""Vendor-compatible alias: ``from moegrad.ops import moe_finalize_routing_grad`` (api.md)."""
from . import (moe_finalize_routing, moe_finalize_routing_grad, moe_gating_top_k,  # noqa: F401
               moe_gating_top_k_backward, moe_init_routing, moe_init_routing_grad,
               swiglu_group, swiglu_group_quant, swiglu_group_quant_backward)
