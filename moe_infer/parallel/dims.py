"""Parallel degrees and the named-axis device meshes built from them (torchtitan's `ParallelDims`).

`ParallelDims` holds pp (pipeline stages), tp (attention heads split) and ep (experts split) and
derives the rest; `__post_init__` checks them against the world size torchrun started. One
pipeline stage has S = lcm(tp, ep) ranks, laid out row-major (rank = stage * S + index in stage):

    mesh        (pp, dp, tp)       attention, dense MLPs, shared experts, embedding and LM head:
                                   heads / intermediate / vocab split over "tp"; dp = S / tp
                                   attention replicas (tp < ep): they run the same requests, or each its
                                   own with `dp_attention` (below)
    moe_mesh    (pp, moe_tp, ep)   routed experts: split over "ep" (which spans the tp and dp ranks
                                   of the stage, as vLLM and SGLang do); each expert's intermediate
                                   dimension F split over moe_tp = S / ep ranks (ep = 1, tp > 1:
                                   tensor-parallel MoE)
    stage_mesh  (pp, stage)        "pp": the same in-stage index of every stage (hidden states go
                                   from stage s to s + 1 along it); "stage": every rank of a stage

The world must be exactly pp * S ranks: more would run duplicate engines, fewer cannot hold the
layout. dp > 1 only appears when ep > tp. By default the dp replicas share the requests (every rank of
the stage holds the same T tokens). With `dp_attention` (SGLang's DP attention) replica r runs its own
requests with its own KV cache (block ids local to it); every replica's step segment is padded to the
same T rows so that all ranks replay the same graph bucket. What crosses per step and MoE layer, T rows of
D values a replica:

    before the experts    all-gather over "dp" of the replicas' hidden states: (dp - 1) * T * D values
                          received a rank (and the padding mask, T bytes a replica, once a forward)
    after the experts     reduce-scatter over the stage into its S ranks (replica-major), each replica's
                          T rows then all-gathered over its "tp" ranks: about (S - 1) / S * dp*T*D +
                          (tp - 1) / tp * T*D values sent a rank, where the all-reduce without it sends
                          2 (S - 1) / S * T*D of dp times fewer tokens
    step inputs           every replica's segment (the driver's one broadcast, dp x one replica's bytes)
    sampling              the sampling rows' hidden states (a replica's padded count x D), gathered over "dp";
                          replica 0 computes the LM head of every replica's rows and the driver samples
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    pp: int = 1
    tp: int = 1
    ep: int = 1
    dp_attention: bool = False  # each attention replica runs its own requests (needs dp > 1)

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "tp", "ep"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.world_size != self.pp * self.stage_size:
            raise ValueError(
                f"torchrun started {self.world_size} process(es) (WORLD_SIZE) but parallel.pp={self.pp} x "
                f"lcm(parallel.tp={self.tp}, parallel.ep={self.ep})={self.stage_size} needs {self.pp * self.stage_size}: "
                f"start {self.pp * self.stage_size} (torchrun --nnodes N --nproc-per-node G with N*G = "
                f"{self.pp * self.stage_size}) or change the parallel sizes")
        if self.dp_attention and self.dp == 1:
            raise ValueError(
                f"parallel.dp_attention=true needs attention replicas (dp = lcm(tp, ep) / tp > 1), but "
                f"parallel.tp={self.tp}, parallel.ep={self.ep} give dp={self.dp}: raise ep above tp (e.g. ep = "
                f"{2 * self.tp}) or turn dp_attention off")

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: lcm(tp, ep)."""
        return self.tp * self.ep // math.gcd(self.tp, self.ep)

    @property
    def dp(self) -> int:
        """Attention replicas per stage (running the same requests, or each its own with dp_attention)."""
        return self.stage_size // self.tp

    @property
    def moe_tp(self) -> int:
        """Ranks each routed expert's intermediate dimension is split over."""
        return self.stage_size // self.ep

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    @property
    def num_replicas(self) -> int:
        """Replicas with requests of their own: dp with dp_attention, else 1."""
        return self.dp if self.dp_attention else 1

    def coords(self, rank: int) -> Tuple[int, int]:
        """(stage, index within the stage) of a global rank."""
        return divmod(rank, self.stage_size)

    def rank_of(self, stage: int, index: int) -> int:
        return stage * self.stage_size + index

    def build_meshes(self, device_type: str) -> Tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
        """(mesh, moe_mesh, stage_mesh); collective over the whole world (every rank must call it)."""
        mesh = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        moe_mesh = init_device_mesh(device_type, (self.pp, self.moe_tp, self.ep),
                                    mesh_dim_names=("pp", "moe_tp", "ep"))
        stage_mesh = init_device_mesh(device_type, (self.pp, self.stage_size), mesh_dim_names=("pp", "stage"))
        return mesh, moe_mesh, stage_mesh


def stage_layers(num_layers: int, pp: int, partition: Optional[Sequence[int]] = None) -> List[Tuple[int, int]]:
    """[start, end) of the decoder layers of each stage.

    partition: layers per stage (must sum to num_layers, each >= 1). Default: as even as possible, the
    extra layers on the stages before the last, from the second-to-last back (the first stage also
    embeds, the last computes the LM head and samples).
    """
    if partition is not None:
        sizes = [int(n) for n in partition]
        if len(sizes) != pp or any(n < 1 for n in sizes) or sum(sizes) != num_layers:
            raise ValueError(f"parallel.pp_layer_partition={list(partition)} must list pp={pp} positive layer "
                             f"counts summing to the model's {num_layers} layers")
    else:
        if num_layers < pp:
            raise ValueError(f"parallel.pp={pp} stages for a model of {num_layers} layers: every stage needs a layer")
        base, extra = divmod(num_layers, pp)
        sizes = [base] * pp
        for i in range(extra):
            sizes[(pp - 2 - i) % pp] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [(s, s + n) for s, n in zip(starts, sizes)]
