"""The mesh as one rank sees it: `ParallelContext`, built by `moe_infer.parallel.init` (startup.py).

It hands every part the process group it needs, taken from the named meshes of `ParallelDims`:
the model its `ModelShard` (tensor-parallel axes, stage layers), the MoE layers their EP dispatcher,
the step pipeline its transfer groups. Nothing else looks up a group.

Groups beside the meshes (all gloo, CPU): `control_group` (world) and `stage_control_group` carry
the step headers, start-up agreement and end-of-generate messages: they wait as long as a rank may
sit idle between requests; `results_group` ([0, sampler rank], `parallel.timeout_s`) brings sampled
tokens back to the driver when the last stage is elsewhere. Rank 0 is the driver (scheduler, printing);
the first rank of the last stage samples.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, is_dataclass
from functools import partial
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from moe_infer.config import ParallelConfig, RoutingConfig
from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.layers.tensor_parallel import SINGLE, ShardGroup
from moe_infer.models.shard import ModelShard
from moe_infer.parallel import capacity_dispatch, exact, reduce_dispatch  # noqa: F401  (register the backends)
from moe_infer.parallel.all_to_all import DISPATCHERS
from moe_infer.parallel.dims import ParallelDims, stage_layers
from moe_infer.parallel.health import MeshError, mesh_error
from moe_infer.parallel.placement import (ExpertPlacement, contiguous_placement, load_layer_placements,
                                          load_placement, replicate_hot_experts)

CAPACITY_POLICIES_FOR_A2A = ("drop", "reroute")


# run before the process groups are destroyed, for every engine of the process (they share the groups): each frees
# its CUDA graphs there, since NCCL's communicator teardown hangs while a graph that captured its collectives is
# alive (pytorch/pytorch#115388; seen on 2 x H200 in the mesh benchmark, both ranks in destroy_process_group)
BEFORE_TEARDOWN: List[Callable[[], None]] = []


@dataclass
class ParallelContext:
    cfg: ParallelConfig
    dims: ParallelDims
    rank: int
    device: torch.device
    mesh: Any = None  # DeviceMesh (pp, dp, tp); None on a single rank
    moe_mesh: Any = None  # DeviceMesh (pp, moe_tp, ep)
    stage_mesh: Any = None  # DeviceMesh (pp, stage)
    world_group: Optional[dist.ProcessGroup] = None
    control_group: Optional[dist.ProcessGroup] = None
    stage_control_group: Optional[dist.ProcessGroup] = None
    results_group: Optional[dist.ProcessGroup] = None
    failed: bool = False  # a MeshError was raised: exit without a collective teardown
    _stage_axis: Optional[ShardGroup] = None  # `stage_axis`, made once

    # ---- where this rank sits -----------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return self.world_group is not None

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and prints."""
        return self.rank == 0

    @property
    def stage(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def stage_index(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.dims.pp - 1

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: the first of the last stage (rank 0 without pipeline stages)."""
        return self.dims.rank_of(self.dims.pp - 1, 0)

    @property
    def next_rank(self) -> int:
        return self.dims.rank_of(self.stage + 1, self.stage_index)

    @property
    def prev_rank(self) -> int:
        return self.dims.rank_of(self.stage - 1, self.stage_index)

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        return self.moe_mesh.get_group("ep") if self.moe_mesh is not None else None

    @property
    def ep_rank(self) -> int:
        return self.moe_mesh.get_local_rank("ep") if self.moe_mesh is not None else 0

    # ---- failures -----------------------------------------------------------------------------
    def failure(self, what: str, err: BaseException, ranks: Optional[List[int]] = None) -> MeshError:
        """The MeshError naming the rank behind a failed collective over `ranks` (default: the world)."""
        self.failed = True
        ranks = list(range(self.dims.world_size)) if ranks is None else ranks
        return mesh_error(what, err, ranks, self.rank, self.cfg.timeout_s)

    def _on_error(self, group: dist.ProcessGroup):
        ranks = dist.get_process_group_ranks(group)
        return lambda what, err: self.failure(what, err, ranks)

    def _axis(self, mesh: Any, axis: str, size: int) -> ShardGroup:
        """The ShardGroup of one mesh axis; SINGLE for an axis of one rank, except under parallel.force_mesh, where
        its collectives run over the group of one rank (what the mesh costs at degree 1)."""
        if size == 1 and not self.cfg.force_mesh:
            return SINGLE
        group = mesh.get_group(axis)
        return ShardGroup(group, mesh.get_local_rank(axis), size, on_error=self._on_error(group),
                          always=self.cfg.force_mesh)

    # ---- what the model and the MoE layers get ------------------------------------------------
    def model_shard(self, num_layers: int) -> ModelShard:
        """This rank's stage layers and tensor-parallel axes."""
        if not self.is_distributed:
            return ModelShard()
        start, end = stage_layers(num_layers, self.dims.pp, self.cfg.pp_layer_partition)[self.stage]
        tp = self._axis(self.mesh, "tp", self.dims.tp)
        moe_tp = self._axis(self.moe_mesh, "moe_tp", self.dims.moe_tp)
        if tp.communicates and moe_tp.communicates and (dist.get_process_group_ranks(tp.group)
                                                        == dist.get_process_group_ranks(moe_tp.group)):
            moe_tp = tp  # the same ranks: the MoE layer then sums routed and shared experts in one all-reduce
        return ModelShard(tp=tp, moe_tp=moe_tp, stage_axis=self.stage_axis(tp), dp=self.dp_axis(),
                          layer_start=start, layer_end=end,
                          is_first_stage=self.is_first_stage,
                          is_last_stage=self.is_last_stage, stage=self.stage, num_stages=self.dims.pp)

    def placement(self, num_experts: int) -> ExpertPlacement:
        """The placement file's shared placement, else contiguous (+ `num_redundant_experts` replicas
        spread over the ranks: a starting point for online re-balancing to move)."""
        if self.cfg.placement_file:
            return load_placement(self.cfg.placement_file, num_experts, self.dims.ep)
        if self.cfg.num_redundant_experts:
            return replicate_hot_experts([1.0] * num_experts, self.dims.ep, self.cfg.num_redundant_experts)
        return contiguous_placement(num_experts, self.dims.ep)

    def dispatcher_name(self, tokens_replicated: bool = True, resident: bool = True) -> str:
        """`parallel.dispatcher`, with "auto" resolved: "reduce" where every EP rank holds the same tokens and the
        experts are resident (no tokens move: one all-reduce a layer, parallel/reduce_dispatch.py), else "exact"."""
        name = self.cfg.dispatcher
        if name == "auto":
            return "reduce" if tokens_replicated and resident else "exact"
        if name == "reduce" and not tokens_replicated:
            raise ValueError("parallel.dispatcher=reduce needs every EP rank to hold the same tokens")
        if name == "reduce" and not resident:
            raise ValueError("parallel.dispatcher=reduce runs resident experts only: with offload.store=cpu|nvme use "
                             "parallel.dispatcher=exact or capacity (or auto)")
        return name

    def make_dispatcher(self, num_experts: int, top_k: int, routing: RoutingConfig,
                        tokens_replicated: bool = True, resident: bool = True) -> LocalDispatcher:
        """The dispatcher for `MoEBackends.dispatcher` (shared by every MoE layer of the model).

        tokens_replicated: every EP rank holds the same tokens (the engine's case: attention is tensor
        parallel or replicated within a stage); each rank then routes 1/ep of them. False: each rank
        brings its own tokens. resident: the experts' weights stay on the device (no offloading store).
        """
        if self.dims.ep == 1:
            return LocalDispatcher(num_experts)
        name = self.dispatcher_name(tokens_replicated, resident)
        kwargs = {}
        if name == "capacity":
            if routing.policy not in CAPACITY_POLICIES_FOR_A2A:
                raise ValueError(f"parallel.dispatcher=capacity needs a capacity policy (routing.policy in "
                                 f"{CAPACITY_POLICIES_FOR_A2A}), got routing.policy={routing.policy!r}")
            from moe_infer.routing.capacity import expert_capacity

            kwargs["capacity_fn"] = partial(expert_capacity, top_k=top_k, num_experts=num_experts,
                                            capacity_factor=routing.capacity_factor, min_capacity=routing.min_capacity)
        dispatcher = DISPATCHERS.get(name)(
            self.placement(num_experts), self.ep_group, self.ep_rank, top_k, overlap=self.cfg.overlap,
            overlap_min_mb=self.cfg.overlap_min_mb, overlap_micro_batches=self.cfg.overlap_micro_batches,
            tokens_replicated=tokens_replicated, on_error=self._on_error(self.ep_group), **kwargs,
        )
        if self.cfg.placement_file:  # per-layer placements (each MoE layer takes its own: `for_layer`)
            dispatcher.layer_placements = load_layer_placements(self.cfg.placement_file, num_experts, self.dims.ep)
        dispatcher.per_layer = bool(dispatcher.layer_placements) or self.cfg.enable_eplb
        return dispatcher

    def dp_axis(self) -> ShardGroup:
        """The attention replicas of this rank's stage (the ranks of its tp index) where each runs its own requests
        (parallel.dp_attention), else SINGLE."""
        if not self.dims.dp_attention or not self.is_distributed:
            return SINGLE
        if self.dims.dp == self.dims.stage_size:  # tp = 1: the replicas are the stage, one communicator for both
            return self.stage_axis()
        return self._axis(self.mesh, "dp", self.dims.dp)

    @property
    def replica(self) -> int:
        """This rank's attention replica within its stage (0 without dp_attention)."""
        return self.dims.coords(self.rank)[1] // self.dims.tp if self.dims.dp_attention else 0

    def stage_axis(self, tp: Optional[ShardGroup] = None) -> ShardGroup:
        """Every rank of this rank's stage as one axis: the tensor-parallel axis itself where it spans the stage (the
        replicas' axis where they do, under attention data parallelism), so
        that a step's graphs hold the collectives of one communicator (NCCL has seen CUDA deadlock when graphs
        holding several communicators' operations are launched from one thread)."""
        if self._stage_axis is None:
            tp = self._axis(self.mesh, "tp", self.dims.tp) if tp is None else tp
            if tp.size == self.dims.stage_size:
                self._stage_axis = tp
            elif self.dims.dp_attention and self.dims.dp == self.dims.stage_size:  # the replicas span the stage
                self._stage_axis = self._axis(self.mesh, "dp", self.dims.dp)
            else:
                self._stage_axis = self._axis(self.stage_mesh, "stage", self.dims.stage_size)
        return self._stage_axis

    def stage_broadcast(self, tensor: torch.Tensor) -> None:
        """tensor from the driver (rank 0) to every rank of the first stage, over the device group, in place (nothing
        to do in a stage of one rank, unless parallel.force_mesh keeps its collectives)."""
        axis = self.stage_axis()
        if not axis.communicates:
            return
        try:
            dist.broadcast(tensor, src=0, group=axis.group)
        except RuntimeError as err:
            ranks = [self.dims.rank_of(0, i) for i in range(self.dims.stage_size)]
            raise self.failure("broadcasting the step's inputs over the first stage", err, ranks) from err

    # ---- control messages (CPU, gloo) ---------------------------------------------------------
    def broadcast_object(self, obj: Any) -> Any:
        """obj from rank 0 (the driver) to every rank; identity on a single rank."""
        if not self.is_distributed:
            return obj
        box = [obj if self.is_driver else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control_group)
        except RuntimeError as err:
            raise self.failure("broadcast from the driver", err) from err
        return box[0]

    def agree_min(self, value: int) -> int:
        """The smallest value over the ranks (e.g. KV blocks: the driver's block ids must exist everywhere)."""
        if not self.is_distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        except RuntimeError as err:
            raise self.failure("start-up agreement", err) from err
        return int(t.item())

    def check_same_config(self, config: Any) -> None:
        """Raise on every rank, naming the fields, if the ranks were not given the same config."""
        if not self.is_distributed:
            return
        flat = _flatten(asdict(config) if is_dataclass(config) else dict(config))
        gathered: list = [None] * self.dims.world_size
        dist.all_gather_object(gathered, flat, group=self.control_group)
        diffs = []
        for r, other in enumerate(gathered):
            for key in sorted(set(flat) | set(other)):
                if gathered[0].get(key) != other.get(key):
                    diffs.append(f"{key}: rank 0 has {gathered[0].get(key)!r}, rank {r} has {other.get(key)!r}")
        if diffs:
            raise ValueError("ranks were started with different configs: " + "; ".join(diffs[:10]))

    @staticmethod
    def on_teardown(fn: Callable[[], None]) -> None:
        """Run fn before the process groups are destroyed (`shutdown`, or the exit hook)."""
        BEFORE_TEARDOWN.append(fn)

    @staticmethod
    def run_before_teardown() -> None:
        while BEFORE_TEARDOWN:
            BEFORE_TEARDOWN.pop()()

    def shutdown(self) -> None:
        """Barrier, then destroy every process group (also done at exit: see startup.py)."""
        if self.is_distributed and dist.is_initialized() and not self.failed:
            self.run_before_teardown()
            dist.barrier(group=self.control_group)
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
