"""Cache policies: which unpinned expert a full slot table gives up. Registry `CACHE_POLICIES`.

A policy only ranks; the slot table (slots.py) decides what may be evicted at all (never an expert
the running step or an in-flight prefetch needs). Keys are whatever the table caches: a local
expert id (GPU cache of one layer) or a (layer, expert) pair (the NVMe tier's host cache).

    lru  least recently used
    lfu  frequency-aware: the fewest routed rows, counted from the same per-step expert loads the
         load statistics record and decayed each step (hot experts stay; a shift in the traffic
         is followed within ~1 / (1 - decay) steps); ties by recency
"""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, Tuple

from moe_infer.registry import Registry

CACHE_POLICIES: Registry[type] = Registry("offload cache policy")


@CACHE_POLICIES.register("lru")
class LRUPolicy:
    def __init__(self) -> None:
        self.clock = 0
        self.last_used: Dict[Hashable, int] = {}

    def touch(self, key: Hashable) -> None:
        self.clock += 1
        self.last_used[key] = self.clock

    def observe(self, rows: Dict[Hashable, int]) -> None:
        """Routed rows per key of one step (unused by LRU)."""

    def forget(self, key: Hashable) -> None:
        self.last_used.pop(key, None)

    def rank(self, key: Hashable) -> tuple:
        return (self.last_used.get(key, 0),)

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        return min(candidates, key=self.rank)


@CACHE_POLICIES.register("lfu")
class LFUPolicy(LRUPolicy):
    def __init__(self, decay: float = 0.95) -> None:
        super().__init__()
        self.decay, self.steps = decay, 0
        self.freq: Dict[Hashable, Tuple[float, int]] = {}  # (rows, step of that value): decayed lazily

    def _now(self, key: Hashable) -> float:
        value, step = self.freq.get(key, (0.0, self.steps))
        return value * self.decay ** (self.steps - step)

    def observe(self, rows: Dict[Hashable, int]) -> None:
        self.steps += 1
        for key, n in rows.items():
            self.freq[key] = (self._now(key) + n, self.steps)

    def rank(self, key: Hashable) -> tuple:  # the frequency outlives an eviction: that is the point
        return (self._now(key), self.last_used.get(key, 0))
