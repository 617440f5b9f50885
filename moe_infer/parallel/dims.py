"""Parallel degrees and the named-axis device meshes built from them (torchtitan style).

`ParallelDims` holds pp (pipeline stages), tp (attention heads split), ep (experts split) and the
derived dp (attention replicas per stage) and checks them against the world size in
`__post_init__`. Two meshes over the same ranks:

    mesh     (pp, dp, tp)                  attention: heads split over "tp"
    ep_mesh  (pp, ep_replicas, ep)         experts: split over "ep", which spans the tp and dp
                                           ranks of one stage (as in vLLM and SGLang)

Ranks are laid out row-major, so the "ep" axis of `ep_mesh` holds consecutive ranks of one stage.
Process groups come from the meshes (`mesh.get_group(axis)`) and are handed to whatever needs one;
nothing looks up a global group.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    pp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "tp", "ep"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.world_size % (self.pp * self.tp):
            raise ValueError(f"world size {self.world_size} is not divisible by pp*tp = {self.pp}*{self.tp}")
        if self.stage_size % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide the ranks of one pipeline stage "
                             f"(world {self.world_size} / pp {self.pp} = {self.stage_size})")

    @property
    def stage_size(self) -> int:
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        """Attention replicas per stage."""
        return self.stage_size // self.tp

    @property
    def ep_replicas(self) -> int:
        """Copies of the full expert set per stage."""
        return self.stage_size // self.ep

    @property
    def is_ep(self) -> bool:
        return self.ep > 1

    def build_meshes(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """(mesh, ep_mesh); collective over the whole world (every rank must call it)."""
        mesh = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        ep_mesh = init_device_mesh(
            device_type, (self.pp, self.ep_replicas, self.ep), mesh_dim_names=("pp", "ep_replicas", "ep")
        )
        return mesh, ep_mesh
