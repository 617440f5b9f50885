"""Process-group start-up for `torchrun ... -m moe_infer.launch parallel.ep=N`: `init(cfg) -> ParallelContext`.

`init` starts torch.distributed from torchrun's environment (NCCL on CUDA, gloo on CPU) with
`parallel.timeout_s` on every collective, builds the meshes (`ParallelDims`), checks that every
rank was given the same config, and hands out the EP dispatcher (`make_dispatcher`) with the EP
process group taken from the mesh. Rank 0 is the driver: it runs the scheduler and prints; the
other ranks receive each step's plan through `broadcast_object`.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, is_dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_infer.config import ParallelConfig, RoutingConfig
from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.parallel import capacity_dispatch, exact  # noqa: F401  (register the backends)
from moe_infer.parallel.dims import ParallelDims
from moe_infer.parallel.all_to_all import DISPATCHERS
from moe_infer.parallel.placement import (ExpertPlacement, contiguous_placement, load_layer_placements,
                                          load_placement, replicate_hot_experts)

CAPACITY_POLICIES_FOR_A2A = ("drop", "reroute")


@dataclass
class ParallelContext:
    cfg: ParallelConfig
    dims: ParallelDims
    rank: int
    device: torch.device
    mesh: Any = None  # DeviceMesh (pp, dp, tp), None on a single rank
    ep_mesh: Any = None  # DeviceMesh (pp, ep_replicas, ep)
    world_group: Optional[dist.ProcessGroup] = None

    @property
    def is_distributed(self) -> bool:
        return self.world_group is not None

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and prints."""
        return self.rank == 0

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        return self.ep_mesh.get_group("ep") if self.ep_mesh is not None else None

    @property
    def ep_rank(self) -> int:
        return self.ep_mesh.get_local_rank("ep") if self.ep_mesh is not None else 0

    def placement(self, num_experts: int) -> ExpertPlacement:
        """The placement file's shared placement, else contiguous (+ `num_redundant_experts` replicas
        spread over the ranks: a starting point for online re-balancing to move)."""
        if self.cfg.placement_file:
            return load_placement(self.cfg.placement_file, num_experts, self.dims.ep)
        if self.cfg.num_redundant_experts:
            return replicate_hot_experts([1.0] * num_experts, self.dims.ep, self.cfg.num_redundant_experts)
        return contiguous_placement(num_experts, self.dims.ep)

    def make_dispatcher(self, num_experts: int, top_k: int, routing: RoutingConfig,
                        tokens_replicated: bool = True) -> LocalDispatcher:
        """The dispatcher for `MoEBackends.dispatcher` (shared by every MoE layer of the model).

        tokens_replicated: every EP rank holds the same tokens (attention replicated, the engine's
        case); each rank then routes 1/ep of them. False: each rank brings its own tokens.
        """
        if self.dims.ep == 1:
            return LocalDispatcher(num_experts)
        kwargs = {}
        if self.cfg.dispatcher == "capacity":
            if routing.policy not in CAPACITY_POLICIES_FOR_A2A:
                raise ValueError(f"parallel.dispatcher=capacity needs a capacity policy (routing.policy in "
                                 f"{CAPACITY_POLICIES_FOR_A2A}), got routing.policy={routing.policy!r}")
            from moe_infer.routing.capacity import expert_capacity

            kwargs["capacity_fn"] = partial(expert_capacity, top_k=top_k, num_experts=num_experts,
                                            capacity_factor=routing.capacity_factor, min_capacity=routing.min_capacity)
        dispatcher = DISPATCHERS.get(self.cfg.dispatcher)(
            self.placement(num_experts), self.ep_group, self.ep_rank, top_k, overlap=self.cfg.overlap,
            overlap_min_mb=self.cfg.overlap_min_mb, overlap_micro_batches=self.cfg.overlap_micro_batches,
            tokens_replicated=tokens_replicated, **kwargs,
        )
        if self.cfg.placement_file:  # per-layer placements (each MoE layer takes its own: `for_layer`)
            dispatcher.layer_placements = load_layer_placements(self.cfg.placement_file, num_experts, self.dims.ep)
        dispatcher.per_layer = bool(dispatcher.layer_placements) or self.cfg.enable_eplb
        return dispatcher

    def broadcast_object(self, obj: Any) -> Any:
        """obj from rank 0 (the driver) to every rank; identity on a single rank."""
        if not self.is_distributed:
            return obj
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.world_group, device=self._object_device())
        return box[0]

    def check_same_config(self, config: Any) -> None:
        """Raise on every rank, naming the fields, if the ranks were not given the same config."""
        if not self.is_distributed:
            return
        flat = _flatten(asdict(config) if is_dataclass(config) else dict(config))
        gathered: list = [None] * dist.get_world_size(self.world_group)
        dist.all_gather_object(gathered, flat, group=self.world_group)
        diffs = []
        for r, other in enumerate(gathered):
            for key in sorted(set(flat) | set(other)):
                if gathered[0].get(key) != other.get(key):
                    diffs.append(f"{key}: rank 0 has {gathered[0].get(key)!r}, rank {r} has {other.get(key)!r}")
        if diffs:
            raise ValueError("ranks were started with different configs: " + "; ".join(diffs[:10]))

    def _object_device(self) -> Optional[torch.device]:
        return self.device if self.device.type == "cuda" else None

    def shutdown(self) -> None:
        """Barrier, then destroy every process group. Leaving gloo groups alive until interpreter exit
        can abort a rank ("terminate called without an active exception") while its peers are gone."""
        if self.is_distributed and dist.is_initialized():
            dist.barrier(group=self.world_group)
            dist.destroy_process_group()
            self.world_group = None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True, default=str)
    return out


def init(cfg: ParallelConfig, device: str = "auto", config_to_check: Any = None) -> ParallelContext:
    """Start the process group (under torchrun) or return a single-rank context (ep=tp=pp=1).

    config_to_check: the whole engine config; every rank must hold the same (checked at start-up).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    needed = cfg.tp * cfg.pp * cfg.ep
    if world_size == 1 and needed == 1:
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                           ("cpu" if device == "auto" else device))
        return ParallelContext(cfg=cfg, dims=ParallelDims(1), rank=0, device=dev)
    if "RANK" not in os.environ:
        raise RuntimeError(f"parallel.ep={cfg.ep} (tp={cfg.tp}, pp={cfg.pp}) needs several processes: "
                           f"start with torchrun --nproc-per-node {needed} -m moe_infer.launch ...")
    if cfg.tp != 1 or cfg.pp != 1:
        raise NotImplementedError("parallel.tp and parallel.pp > 1 are not implemented yet (attention is "
                                  "replicated over the EP ranks): use parallel.ep only")
    dims = ParallelDims(world_size, pp=cfg.pp, tp=cfg.tp, ep=cfg.ep)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = (device == "auto" and torch.cuda.is_available()) or device.startswith("cuda")
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=cfg.timeout_s))
    world_group = dist.group.WORLD  # created here, by this function; everything else gets it injected
    mesh, ep_mesh = dims.build_meshes(dev.type)
    ctx = ParallelContext(cfg=cfg, dims=dims, rank=rank, device=dev, mesh=mesh, ep_mesh=ep_mesh,
                          world_group=world_group)
    ctx.check_same_config(config_to_check if config_to_check is not None else cfg)
    return ctx
