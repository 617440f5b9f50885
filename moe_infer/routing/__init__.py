"""Routing: router logits -> top-k experts -> capacity policy -> load statistics."""
from moe_infer.routing.capacity import CAPACITY_POLICIES
from moe_infer.routing.select import ROUTING_BACKENDS, select_experts_torch
from moe_infer.routing.spec import RoutingSpec

__all__ = ["CAPACITY_POLICIES", "ROUTING_BACKENDS", "RoutingSpec", "select_experts_torch"]
