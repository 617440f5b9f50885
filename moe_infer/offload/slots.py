"""A slot table: a fixed pool of slots, which key each holds, which keys are pinned.

Slots are to experts what KV blocks are to tokens: the table maps keys (experts) to slot ids and
never moves bytes itself; the store copies into the slot it is given. Pins say why a key must stay:
`step` (the running layer step computes with it) and `prefetch` (a copy for the next layer is in
flight or landed and not yet used). `allocate` takes a free slot, else the policy's victim among
the unpinned keys (or the unpinned key it is told to evict), else returns None: a pinned key is
never evicted.

`is_pinned` is a dict lookup (a count of the kinds that pin each key), not a scan over the kinds: a step
that misses many experts calls `allocate`, and so `evictable`, once per miss (at 16 streams of the
Qwen3-30B-A3B shape, about 45 misses over 38 slots a layer, 48 layers a step).
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Set, Tuple

PIN_KINDS = ("step", "prefetch")


class SlotTable:
    def __init__(self, num_slots: int, policy) -> None:
        self.num_slots = num_slots
        self.policy = policy
        self.slot_of: Dict[Hashable, int] = {}
        self.key_in: List[Optional[Hashable]] = [None] * num_slots
        self.free: List[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.pins: Dict[str, Set[Hashable]] = {kind: set() for kind in PIN_KINDS}
        self._pin_count: Dict[Hashable, int] = {}  # key -> how many kinds pin it (absent: none)

    def lookup(self, key: Hashable) -> Optional[int]:
        return self.slot_of.get(key)

    def is_pinned(self, key: Hashable) -> bool:
        return key in self._pin_count

    def pin(self, key: Hashable, kind: str) -> None:
        pinned = self.pins[kind]
        if key not in pinned:
            pinned.add(key)
            self._pin_count[key] = self._pin_count.get(key, 0) + 1

    def unpin_all(self, kind: str) -> Set[Hashable]:
        released, self.pins[kind] = self.pins[kind], set()
        for key in released:
            left = self._pin_count[key] - 1
            if left:
                self._pin_count[key] = left
            else:
                del self._pin_count[key]
        return released

    def touch(self, key: Hashable) -> None:
        self.policy.touch(key)

    def evictable(self) -> List[Hashable]:
        pinned = self._pin_count
        return [k for k in self.slot_of if k not in pinned]

    def allocate(self, key: Hashable, victim: Optional[Hashable] = None) -> Optional[Tuple[int, Optional[Hashable]]]:
        """(slot, evicted key or None) for a key not in the table, or None when every slot is pinned. A
        free slot first, else the policy's victim among the unpinned keys; `victim`: evict that key (it
        must be in the table and unpinned)."""
        if key in self.slot_of:
            raise ValueError(f"{key!r} already holds slot {self.slot_of[key]}")
        if victim is not None and (victim not in self.slot_of or self.is_pinned(victim)):
            raise ValueError(f"cannot evict {victim!r}: it is {'pinned' if victim in self.slot_of else 'not cached'}")
        evicted = None
        if self.free and victim is None:
            slot = self.free.pop()
        else:
            candidates = self.evictable() if victim is None else [victim]
            if not candidates:
                return None
            evicted = self.policy.victim(candidates)
            slot = self.slot_of.pop(evicted)
            self.policy.forget(evicted)
        self.slot_of[key] = slot
        self.key_in[slot] = key
        self.policy.touch(key)
        return slot, evicted
