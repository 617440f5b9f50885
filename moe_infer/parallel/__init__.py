"""Parallelism: the device meshes (`ParallelDims`), expert placement and the all-to-all dispatchers.

`init(cfg.parallel) -> ParallelContext` starts the process group under torchrun;
`ctx.make_dispatcher(...)` gives the dispatcher for `MoEBackends.dispatcher`.
"""
from moe_infer.parallel.capacity_dispatch import CapacityDispatcher
from moe_infer.parallel.context import ParallelContext, init
from moe_infer.parallel.dims import ParallelDims
from moe_infer.parallel.all_to_all import DISPATCHERS, A2ADispatcher, A2AMetadata, RoutePlan
from moe_infer.parallel.exact import ExactDispatcher
from moe_infer.parallel.placement import ExpertPlacement, contiguous_placement, load_placement, replicate_hot_experts

__all__ = [
    "A2ADispatcher", "A2AMetadata", "CapacityDispatcher", "DISPATCHERS", "ExactDispatcher", "ExpertPlacement",
    "ParallelContext", "ParallelDims", "RoutePlan", "contiguous_placement", "init", "load_placement",
    "replicate_hot_experts",
]
