"""What part of the model one rank builds and loads: its pipeline stage's layers and its tensor shards.

Built by the mesh (`moe_infer.parallel.ParallelContext.model_shard`); the default is the whole model
on one rank. The decoder builds only the layers [layer_start, layer_end) (the others are
placeholders so that parameter names keep their global layer index), the embedding on the first
stage and the final norm + LM head on the last; the loader reads only those tensors, sliced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_infer.layers.tensor_parallel import SINGLE, ShardGroup


@dataclass(frozen=True)
class ModelShard:
    tp: ShardGroup = SINGLE  # attention heads, dense / shared-expert intermediate, vocabulary
    moe_tp: ShardGroup = SINGLE  # each routed expert's intermediate dimension
    # every rank of the pipeline stage: what an EP dispatcher's partial sums are reduced over (reduce_dispatch.py)
    stage_axis: ShardGroup = SINGLE
    # attention data parallelism: the replicas of the stage, each with its own tokens (SINGLE without it); the MoE
    # layers gather their tokens over it (moe_infer/layers/moe.py)
    dp: ShardGroup = SINGLE
    layer_start: int = 0
    layer_end: Optional[int] = None  # None: to the last layer
    is_first_stage: bool = True
    is_last_stage: bool = True
    stage: int = 0
    num_stages: int = 1

    def layer_range(self, num_layers: int) -> range:
        end = num_layers if self.layer_end is None else self.layer_end
        if not 0 <= self.layer_start < end <= num_layers:
            raise ValueError(f"stage layers [{self.layer_start}, {end}) outside the model's {num_layers} layers")
        return range(self.layer_start, end)

    @property
    def is_whole(self) -> bool:
        return self.tp.size == 1 and self.moe_tp.size == 1 and self.num_stages == 1


WHOLE = ModelShard()
