"""Routing: router logits -> top-k experts -> capacity policy -> load statistics, and the token
permutation (rows sorted / block-padded by expert) the dispatcher and the fused experts consume.

Triton backends register on import of `moe_infer.routing.triton_select` (`moe_infer.plugins`).
"""
from moe_infer.routing.capacity import CAPACITY_POLICIES, expert_capacity
from moe_infer.routing.capacity_ops import CAPACITY_KERNELS
from moe_infer.routing.permute import PERMUTE_BACKENDS, BlockLayout, RowPermutation, align_rows_to_blocks, permute_rows
from moe_infer.routing.select import ROUTING_BACKENDS, select_experts_torch
from moe_infer.routing.spec import RoutingSpec
from moe_infer.routing.stats import ExpertLoadStats

__all__ = [
    "BlockLayout", "CAPACITY_KERNELS", "CAPACITY_POLICIES", "ExpertLoadStats", "PERMUTE_BACKENDS", "ROUTING_BACKENDS",
    "RoutingSpec", "RowPermutation", "align_rows_to_blocks", "expert_capacity", "permute_rows", "select_experts_torch",
]
