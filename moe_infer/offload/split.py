"""Sharing a missed expert between the link and the host cores: the expert split along F.

A SwiGLU expert is a sum over its F intermediate rows, out = sum_f silu(x . w1_f) (x . w3_f) w2[:, f],
so the two servers of a miss can work on one expert at once: the host computes the gate/up
projections of its first c rows (act_rc, from two contiguous ranges of the host tier's w13) while the
link copies the rest of w13 (rows [c:F] of gate and of up) and all of w2 into a cache slot whose
gate/up rows [0:c] are zero (silu(0) * 0 = 0, so the fused kernel on the slot computes the rest of
the sum). The GPU adds act_rc @ w2[:, :c].T, reading w2 from the slot. Measured for one Mixtral
expert at one row on an H100 host (benchmarks/results/trials/offload_split_limits_*.log): the link
6.55 ms, the host 6.58 ms for the whole expert; shared at c = 7/8 F, 3.2 ms.

The slot then holds a partial expert (its first c gate/up rows zero: `missing` rows). A later step
that needs it shares the missing rows again, host or link, so a partial slot costs a fraction of a
miss; a prefetch or a whole copy makes a slot complete.

`plan_misses` decides one layer step, per miss policy:
  share  rows move from the link to the host, the host's cheapest rows first (the experts with the
         fewest routed rows), until both would finish together (water-filling the two queues, the
         link's current backlog included); a missed expert whose gate/up rows all went to the host
         is then computed whole on the host if that ends sooner (it saves the link w2). The link
         starts with a credit: the host's own work between this layer step and the next one's sync
         (launching the next layers, `OffloadManager.host_gap_s`, measured) runs under the copies
         but after the host's expert compute, so the link may take that much longer. Measured on
         the H100 (benchmarks/results/trials/offload_layer_time_*.log) that gap is 1.6-2.3 ms a
         Mixtral layer; without the credit the host took rows whose copy would have been hidden.

`share` is not the default: measured on H100s (benchmarks/results/offload_*_share_ab*.log), it moved
15-20 % fewer bytes and gained 1-10 % for one Mixtral stream with traced routing, but lost 5-13 %
with the model's own router (better predictions, so fewer misses to share) and did not help 16
streams. The host's expert compute ran 1.5-2.6x slower in the engine than at start-up (cpu_scale),
and it is serial with the host's launches, which the water-filling above prices only as the credit.
  auto   each missed expert goes whole to the link or the host (offload/cost.py's split_misses),
         partial slots (left by `share`) are completed over the link
  wait   everything over the link; cpu: missed experts whole on the host, partial rows on the host

Legend: D hidden, F expert intermediate, c rows the host computes, m missing rows of a slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from moe_infer.offload.cost import CostModel, split_misses
from moe_infer.offload.plan import ExpertShape


@dataclass
class MissPlan:
    to_copy: List[int] = field(default_factory=list)  # missed experts copied whole into a slot
    to_cpu: List[int] = field(default_factory=list)  # missed experts computed whole on the host
    # expert -> c: the host computes gate/up rows [0:c), the link brings the rest of what is missing
    # (a missed expert: rows [c:F] and w2; a partial slot with m missing rows: rows [c:m])
    shared: Dict[int, int] = field(default_factory=dict)


def granule(shape: ExpertShape) -> int:
    """Rows move between the servers in steps of this many (1/64 of F)."""
    return max(1, shape.intermediate_size // 64)


def _round(rows: float, limit: int, step: int) -> int:
    c = min(limit, int(round(rows / step)) * step)
    return limit if limit - c < step else max(c, 0)


def _unit_costs(cost: CostModel, shape: ExpertShape) -> Tuple[float, float]:
    """(seconds to copy w2, seconds to copy one gate row and its up row) at the measured link rate, in the
    experts' stored format (a quantized weight's rows with their share of its scales)."""
    layout = shape.layout
    return (cost.copy_seconds(layout.nbytes_of("w2")),
            cost.copy_seconds(layout.nbytes_of("w13") / shape.intermediate_size))


def plan_misses(misses: Dict[int, int], partial: Dict[int, Tuple[int, int]], mode: str, cost: CostModel,
                shape: ExpertShape, link_wait_s: float, cpu_lead_s: float = 0.0) -> MissPlan:
    """misses: {expert: routed rows} not in a slot; partial: {expert: (routed rows, missing rows)} in a
    slot that lacks its first `missing` gate/up rows; link_wait_s: the link's backlog (share: less the
    host's credit, so it may be negative); cpu_lead_s: when the host's expert compute will start (after
    it has launched the device's part of the step, OffloadManager.host_lead_s)."""
    if mode in ("auto", "wait", "cpu"):
        to_copy, to_cpu = split_misses(misses, mode, cost, shape.nbytes, link_wait_s, cpu_lead_s=cpu_lead_s)
        return MissPlan(to_copy, to_cpu, {e: (m if mode == "cpu" else 0) for e, (_, m) in partial.items()})
    if mode != "share":
        raise ValueError(f"unknown miss policy {mode!r}")
    F = shape.intermediate_size
    w2_s, row_s = _unit_costs(cost, shape)
    link = link_wait_s + len(misses) * (w2_s + F * row_s) + sum(m * row_s for _, m in partial.values())
    cpu = cpu_lead_s
    shared: Dict[int, int] = {e: 0 for e in partial}
    items = [(n, e, F) for e, n in misses.items()] + [(n, e, m) for e, (n, m) in partial.items()]
    for n, e, m in sorted(items):  # the host's cheapest rows first: experts with the fewest routed rows
        if link <= cpu:
            break
        row_cpu = cost.cpu13_seconds(n) / F
        c = _round((link - cpu) / (row_s + row_cpu), m, granule(shape))
        if c > 0:
            shared[e] = c
            link -= c * row_s
            cpu += c * row_cpu
    to_cpu = []
    for n, e, _ in sorted(items):  # all of an expert's rows on the host: whole there, if that ends sooner
        if e in misses and shared.get(e) == F and link > cpu:
            cpu_whole = cpu - cost.cpu13_seconds(n) + cost.cpu_seconds(n)
            if max(link - w2_s, cpu_whole) < max(link, cpu):
                link, cpu = link - w2_s, cpu_whole
                to_cpu.append(e)
                del shared[e]
    to_copy = sorted(e for e in misses if e not in to_cpu and not shared.get(e))
    for e in to_copy:
        shared.pop(e, None)
    return MissPlan(to_copy, sorted(to_cpu), shared)
