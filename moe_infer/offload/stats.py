"""Offload counters: hit rate, where misses went, bytes moved, prefetch accuracy. Host-side ints.

Per layer step (one MoE layer of one engine step) an expert with at least one routed row is
"needed"; it is a hit when it is in the GPU cache or on its way there (a prefetch in flight), partial
when its slot lacks its first gate/up rows (offload/split.py), else a miss that is copied into the
cache, shared between the link and the CPU, streamed through the double buffers, or computed on the
CPU. cpu_share counts the CPU's part of a shared expert by the bytes of the gate/up rows it computed.
Prefetch accuracy is counted two ways: per token (of the K experts layer l+1's router picks for a
token, how many the pre-gate on layer l's hidden state had picked: the measure of docs/tiny_moe.md)
and per step (of the experts layer l+1 needed, how many were predicted: what a cache sees). A
prefetch is wasted when the layer then does not need the expert it copied.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class OffloadStats:
    layer_steps: int = 0
    needed: int = 0
    hits: int = 0  # ... in a slot with all its weights (or on their way there)
    partial: int = 0  # ... in a slot that lacks its first gate/up rows (offload/split.py)
    prefetch_hits: int = 0  # hits that a prefetch brought in
    copied: int = 0  # misses copied into the cache (waited on)
    streamed: int = 0  # misses run through the stream buffers
    cpu: int = 0  # misses computed on the CPU
    shared: int = 0  # misses shared between the link and the CPU (split along F)
    # gate/up rows the CPU computed of shared misses and partial slots, and the rows partial slots lacked,
    # both in experts' bytes (F rows of gate and up are 2/3 of an expert)
    cpu_shared: float = 0.0
    partial_missing: float = 0.0
    prefetched: int = 0  # experts a prefetch copied
    prefetch_wasted: int = 0  # ... that the layer then did not need
    prefetch_declined: int = 0  # predicted, not cached, and not copied (the prefetch rule or the slots said no)
    prefetch_evicted_needed: int = 0  # experts a prefetch evicted that the layer then needed
    bytes_prefetch_wasted: int = 0
    bytes_h2d: int = 0
    bytes_read: int = 0  # NVMe -> host
    predicted: int = 0  # per step: experts the pre-gate predicted
    predicted_needed: int = 0  # ... of which the layer then needed
    needed_after_prediction: int = 0  # experts needed in layer steps that had a prediction
    token_slots: int = 0  # per token: tokens x K of predicted layer steps
    token_matches: int = 0  # ... picks of the router that the pre-gate had also picked

    def add(self, other: "OffloadStats") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    def summary(self) -> dict:
        def ratio(a: int, b: int) -> float:
            return a / b if b else 0.0

        out = asdict(self)
        out.update(
            hit_rate=ratio(self.hits, self.needed),
            cpu_share=ratio(self.cpu + self.cpu_shared, self.needed),
            shared_share=ratio(self.shared, self.needed),
            partial_share=ratio(self.partial, self.needed),
            stream_share=ratio(self.streamed, self.needed),
            prefetch_recall=ratio(self.predicted_needed, self.needed_after_prediction),
            prefetch_precision=ratio(self.predicted_needed, self.predicted),
            prefetch_token_recall=ratio(self.token_matches, self.token_slots),
            prefetch_waste=ratio(self.prefetch_wasted, self.prefetched),
            gb_h2d=self.bytes_h2d / 1e9,
            gb_prefetch_wasted=self.bytes_prefetch_wasted / 1e9,
            gb_read=self.bytes_read / 1e9,
        )
        return out
