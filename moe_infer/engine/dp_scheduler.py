"""Attention data parallelism on the driver: one `Scheduler` per attention replica, one plan per step.

With `parallel.dp_attention` a pipeline stage holds dp attention replicas, each with its own KV cache. The
driver keeps one `Scheduler` (and `BlockManager`, block ids local to that replica's cache) per replica and
composes them; `Scheduler` itself is unchanged:

  - a new request goes to one replica and stays there (preemption recomputes it there): the replica with the
    fewest running + waiting sequences, ties to the one holding more of its prompt in its prefix cache, then
    the lowest index. The samples of an n > 1 request follow their leader (they wait for its prompt's blocks);
  - a step's plan is the replicas' plans concatenated, replica-major (`SchedulerOutput.parts` keeps each);
    the runner pads every replica's part to the same rows (moe_infer/engine/dp_inputs.py);
  - postprocess / discard split the step's tokens back by replica.

Each replica has the configured budgets (`max_num_seqs`, `max_num_batched_tokens`): the stage runs up to dp times
the sequences of one replica, and its MoE layers up to dp times the tokens.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from moe_infer.engine.block_manager import BlockManager
from moe_infer.engine.scheduler import Scheduler
from moe_infer.engine.sequence import SchedulerOutput, Sequence


class PooledBlocks:
    """The replicas' block managers summed, for the engine's statistics (read-only)."""

    def __init__(self, managers: List[BlockManager]) -> None:
        self.managers = managers
        self.block_size = managers[0].block_size

    def _sum(self, name: str) -> int:
        return sum(getattr(m, name) for m in self.managers)

    num_blocks = property(lambda self: self._sum("num_blocks"))
    num_free_blocks = property(lambda self: self._sum("num_free_blocks"))
    num_prefix_queries = property(lambda self: self._sum("num_prefix_queries"))
    num_prefix_hits = property(lambda self: self._sum("num_prefix_hits"))


class DPScheduler:
    """dp `Scheduler`s behind the `Scheduler` interface the engine uses (see the module docstring)."""

    def __init__(self, num_replicas: int, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 **scheduler_kwargs) -> None:
        if num_replicas < 2:
            raise ValueError(f"a DPScheduler needs at least 2 replicas, got {num_replicas}")
        self.replicas = [Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching), **scheduler_kwargs)
                         for _ in range(num_replicas)]
        self.block_manager = PooledBlocks([r.block_manager for r in self.replicas])
        self.limits = self.replicas[0].limits
        self.lookahead = self.replicas[0].lookahead
        self._replica_of: Dict[int, int] = {}  # seq id -> replica, while the sequence is not finished
        self.num_scheduled_tokens = [0] * num_replicas  # per replica, total (metrics, tests)

    # ------------------------------------------------------------------ requests
    def choose_replica(self, seq: Sequence) -> int:
        """Where a new sequence runs (the module docstring)."""
        if seq.leader is not None and seq.leader.seq_id in self._replica_of:
            return self._replica_of[seq.leader.seq_id]

        def key(i: int):
            r = self.replicas[i]
            return len(r.running) + len(r.waiting), -len(r.block_manager.find_cached_prefix(seq)), i

        return min(range(len(self.replicas)), key=key)

    def add(self, seq: Sequence) -> None:
        i = self.choose_replica(seq)
        self.replicas[i].add(seq)
        if not seq.is_finished:
            self._replica_of[seq.seq_id] = i

    def replica_of(self, seq_id: int) -> Optional[int]:
        return self._replica_of.get(seq_id)

    def _owner(self, seq: Sequence) -> Scheduler:
        return self.replicas[self._replica_of[seq.seq_id]]

    def abort(self, seq: Sequence) -> None:
        if seq.seq_id in self._replica_of:
            self._owner(seq).abort(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: object = None, error: Optional[str] = None) -> None:
        if seq.seq_id in self._replica_of:
            self._owner(seq).finish(seq, reason, stop_reason, error)
        elif not seq.is_finished:
            seq.finish(reason, stop_reason, error)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    @property
    def running(self) -> List[Sequence]:
        return [s for r in self.replicas for s in r.running]

    @property
    def waiting(self) -> List[Sequence]:
        return [s for r in self.replicas for s in r.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.replicas)

    @property
    def num_chunked_prefills(self) -> int:
        return sum(r.num_chunked_prefills for r in self.replicas)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        parts = [r.schedule() for r in self.replicas]
        for i, part in enumerate(parts):
            self.num_scheduled_tokens[i] += part.num_tokens
            for seq_id in part.finished_seq_ids:
                self._replica_of.pop(seq_id, None)
        return SchedulerOutput(seqs=[s for p in parts for s in p.seqs],
                               finished_seq_ids=[i for p in parts for i in p.finished_seq_ids],
                               num_preempted=sum(p.num_preempted for p in parts), parts=parts)

    def postprocess(self, plan: SchedulerOutput, sampled: List[Optional[int]]) -> List[Sequence]:
        updated, at = [], 0
        for replica, part in zip(self.replicas, plan.parts):
            n = len(part.seqs)
            updated += replica.postprocess(part, sampled[at:at + n])
            at += n
        return updated

    def discard(self, plan: SchedulerOutput) -> None:
        for replica, part in zip(self.replicas, plan.parts):
            replica.discard(part)
