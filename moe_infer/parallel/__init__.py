"""Parallelism: the mesh (`ParallelDims`: tp x pp x ep), expert placement, the all-to-all dispatchers and
the step pipeline between the ranks.

`init(cfg.parallel) -> ParallelContext` starts the process groups under torchrun; the context hands
out the model's shard (`model_shard`), the EP dispatcher (`make_dispatcher`) and the groups the
step pipeline (`pipeline.py` on the driver, `follower.py` elsewhere) moves steps over. Users: docs/scaling.md.
"""
from moe_infer.parallel.capacity_dispatch import CapacityDispatcher
from moe_infer.parallel.context import ParallelContext
from moe_infer.parallel.dims import ParallelDims
from moe_infer.parallel.health import MeshError
from moe_infer.parallel.startup import init
from moe_infer.parallel.all_to_all import DISPATCHERS, A2ADispatcher, A2AMetadata, RoutePlan
from moe_infer.parallel.exact import ExactDispatcher
from moe_infer.parallel.placement import ExpertPlacement, contiguous_placement, load_placement, replicate_hot_experts
from moe_infer.parallel.reduce_dispatch import ReduceDispatcher

__all__ = [
    "A2ADispatcher", "A2AMetadata", "CapacityDispatcher", "DISPATCHERS", "ExactDispatcher", "ExpertPlacement",
    "MeshError", "ParallelContext", "ParallelDims", "ReduceDispatcher", "RoutePlan", "contiguous_placement", "init",
    "load_placement",
    "replicate_hot_experts",
]
