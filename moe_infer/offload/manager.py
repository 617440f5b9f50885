"""The offload manager: what the MoE layers' stores share (one per engine).

It holds the plan, the copy stream, the two stream buffers, the cost model (measured once the
weights are in), the counters, and for the NVMe tier the files, the reader and the pinned host
cache in front of them (a slot table keyed by (layer, expert), so a hot expert of any layer stays).
Stores register in model order; `next_store` is whom a layer pre-gates for.

Legend: C experts per stream buffer, H host cache slots, D hidden, F expert intermediate.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from moe_infer import host_threads
from moe_infer.offload.copier import Copier, Event
from moe_infer.offload.cost import CostModel
from moe_infer.offload.expert_graphs import ExpertGraphs
from moe_infer.offload.host import HostRegion
from moe_infer.offload.nvme import NvmeFiles, make_reader, record_views
from moe_infer.offload.plan import OffloadPlan
from moe_infer.offload.policies import CACHE_POLICIES
from moe_infer.offload.prefetch import Prefetcher
from moe_infer.offload.slots import SlotTable
from moe_infer.offload.stats import OffloadStats

logger = logging.getLogger(__name__)


class StreamBuffer:
    """C device slots that large steps stream experts through (each expert's tensors in its stored format,
    offload/layout.py); `last_use` guards their reuse."""

    def __init__(self, plan: OffloadPlan, device: torch.device) -> None:
        layout = plan.shape.layout
        self.tensors = layout.pool(plan.stream_chunk, device)
        self.w13_C2FD, self.w2_CDF = layout.weights(self.tensors)  # the data, carrying the format
        self.last_use: Event = None

    def slot(self, j: int) -> Dict[str, torch.Tensor]:
        return {name: t[j] for name, t in self.tensors.items()}


class OffloadManager:
    def __init__(self, cfg, plan: OffloadPlan, device: torch.device) -> None:
        self.cfg, self.plan, self.device = cfg, plan, torch.device(device)
        self.shape = plan.shape
        self.copier = Copier(self.device)
        self.stores: list = []
        self.step_pinned: set = set()  # stores whose slot tables hold step pins (their _plan ran)
        self.stats: List[OffloadStats] = []
        self.buffers = [StreamBuffer(plan, self.device) for _ in range(2)]
        self.cost: Optional[CostModel] = None
        # the host's own work between a layer step's end and the next one's sync (launching the next
        # layers): the link copies under it, the host's expert compute does not (split.py's credit)
        self.host_gap_s = 0.0
        self.run_end_s: Optional[float] = None
        self.run_end_pos: Optional[int] = None  # the layer whose step ended at run_end_s
        # the host's own work between a layer step's plan and the start of its expert compute (launching
        # the device's experts and copies): the host's misses start that much after the link's (split.py)
        self.host_lead_s = 0.0
        self.prefetcher = Prefetcher(cfg, self)
        self.pin = cfg.pin_memory and self.device.type == "cuda"
        # the device experts of a layer step as CUDA graphs (offload/expert_graphs.py); None: launched eagerly
        self.expert_graphs = ExpertGraphs(self.device) if cfg.expert_graphs and self.device.type == "cuda" else None
        self.nvme: Optional[NvmeFiles] = None
        if plan.store == "nvme":
            self.nvme = NvmeFiles(plan.nvme_dir, self.shape)
            self.reader = make_reader(cfg.nvme_reader)
            self.host_region = HostRegion(plan.host_slots * self.shape.record_bytes, self.pin)
            self.host_tensors = record_views(self.host_region.data.view(plan.host_slots, self.shape.record_bytes),
                                             self.shape)
            self.host_table = SlotTable(plan.host_slots, CACHE_POLICIES.get(cfg.cache_policy)())
            self.host_busy: List[Event] = [None] * plan.host_slots  # the last H2D copy out of each host slot

    # ------------------------------------------------------------------ layers
    def register(self, store) -> int:
        if len(self.stores) >= self.shape.num_layers:
            raise ValueError(f"the offload plan has {self.shape.num_layers} MoE layers; a store for one more was built")
        self.stores.append(store)
        self.stats.append(OffloadStats())
        return len(self.stores) - 1

    def next_store(self, store):
        return self.stores[store.pos + 1] if store.pos + 1 < len(self.stores) else None

    def note_host_gap(self, now: float, pos: Optional[int] = None, weight: float = 0.1, cap_s: float = 0.05) -> None:
        """Layer `pos`'s step is about to sync: the host time since the previous layer step ended, averaged.
        A step of an earlier or the same layer began a new forward: its gap holds the end of the last one
        (the head, sampling, scheduling), not the launches between two layers, and is not averaged."""
        new_forward = pos is not None and self.run_end_pos is not None and pos <= self.run_end_pos
        if self.run_end_s is not None and not new_forward:
            gap = min(max(now - self.run_end_s, 0.0), cap_s)
            self.host_gap_s += weight * (gap - self.host_gap_s)
        self.run_end_s = self.run_end_pos = None

    def note_host_lead(self, lead_s: float, weight: float = 0.1, cap_s: float = 0.05) -> None:
        """A layer step's host expert compute starts `lead_s` after its plan: averaged into host_lead_s."""
        self.host_lead_s += weight * (min(max(lead_s, 0.0), cap_s) - self.host_lead_s)

    def relax_host_lead(self, rate: float = 0.01) -> None:
        """A layer step's misses all went to the link: host_lead_s drifts toward 0. Only the host's own
        expert compute measures the lead, so a lead measured long once (a step of many launches before
        the host's experts, a wide prefill) would keep every later miss off the host cores and never be
        measured again (cost.relax does the same for the CPU scale)."""
        self.host_lead_s -= rate * self.host_lead_s

    def link_wait_s(self) -> float:
        """The link's backlog in seconds; the cost model's link rate follows the one the copies measure."""
        wait = self.copier.seconds_until_idle()
        if self.cost is not None:
            self.cost.h2d_bytes_per_s = self.copier.bytes_per_s
        return wait

    def begin_layer(self, store) -> None:
        """A layer step starts: no other layer step is running, so every step pin is released (the GPU
        side is ordered by the events: a slot is rewritten only after the compute that read it). The
        host cache's prefetch pins go too: a prefetch's reads ended before its copies were queued, and
        `host_busy` keeps a host slot until its copy has run (kept, they pinned the whole host cache
        after enough steps)."""
        for other in self.step_pinned:
            other.table.unpin_all("step")
        self.step_pinned.clear()
        if self.nvme is not None:
            self.host_table.unpin_all("step")
            self.host_table.unpin_all("prefetch")

    # ------------------------------------------------------------------ host tier
    def host_expert(self, store, e: int) -> Dict[str, torch.Tensor]:
        """Expert e of `store` in host memory, its tensors as stored (NVMe: it must have been brought in by
        `ensure_host`)."""
        if self.nvme is None:
            return {name: t[e] for name, t in store.host_tensors.items()}
        h = self.host_table.lookup((store.pos, e))
        if h is None:
            raise RuntimeError(f"expert {e} of MoE layer {store.pos} is not in the host cache")
        return {name: t[h] for name, t in self.host_tensors.items()}

    def host_weights(self, store, e: int, dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13_2FD, w2_DF) for the host's compute: the host tier's tensors as they are, or a
        quantized expert dequantized to dtype (this expert only, for this call)."""
        return self.shape.layout.dequantize(self.host_expert(store, e), dtype or self.shape.dtype)

    def ensure_host(self, store, experts: Iterable[int], pin: str, stats: OffloadStats) -> None:
        """NVMe: read the experts that are not in the host cache (and pin them); waits for the reads."""
        if self.nvme is None:
            return
        issued = 0
        for e in experts:
            key = (store.pos, e)
            self.host_table.pin(key, pin)
            if self.host_table.lookup(key) is not None:
                self.host_table.touch(key)
                continue
            got = self.host_table.allocate(key)
            if got is None:
                raise RuntimeError(f"the host cache's {self.plan.host_slots} slots are all pinned: raise "
                                   "offload.cpu_budget_gb")
            h = got[0]
            if self.host_busy[h] is not None:  # an H2D copy may still read the slot
                self.host_busy[h].synchronize()
                self.host_busy[h] = None
            rec = self.shape.record_bytes
            self.reader.submit(self.host_region.data[h * rec:(h + 1) * rec], store.path, e * rec)
            issued += 1
        if issued:
            self.reader.wait_all()
            stats.bytes_read += issued * self.shape.record_bytes

    def copy_experts(self, store, items: List[Tuple[int, Dict[str, torch.Tensor]]], after: Iterable[Event],
                     stats: OffloadStats) -> Event:
        """Whole experts (e, dst: one slot's tensors) of `store` from the host tier to the device, on the copy
        stream after the events `after`; one event for all of them (None when there is nothing to copy)."""
        F = self.shape.intermediate_size
        return self.copy_rows(store, [(e, dst, 0, F, True) for e, dst in items], after, stats)

    def copy_rows(self, store, items: List[Tuple[int, Dict[str, torch.Tensor], int, int, bool]],
                  after: Iterable[Event], stats: OffloadStats) -> Event:
        """Parts of experts into slots (offload/split.py): (e, dst: one slot's tensors, lo, hi, fresh) copies
        gate and up rows [lo:hi) of expert e; `fresh` (the slot held another expert): also all of w2, and
        gate/up rows [0:lo) zeroed (the host computes those). (e, .., 0, F, True) is a whole expert: every
        tensor of its stored format (data and scales), the only kind a quantized expert moves as. One
        event for all of them, on the copy stream after `after` (None when there is nothing to copy)."""
        if not items:
            return None
        F = self.shape.intermediate_size
        pairs, zeros = [], []
        for e, dst, lo, hi, fresh in items:
            src = self.host_expert(store, e)
            if lo == 0 and hi == F and fresh:
                pairs += [(dst[name], t) for name, t in src.items()]
                continue
            if self.shape.layout.is_quantized:
                raise RuntimeError(f"expert {e}: a quantized expert moves whole (its rows share scale blocks)")
            w13, w2, dst13 = src["w13"], src["w2"], dst["w13"]
            if lo == 0 and hi == F:
                pairs.append((dst13, w13))
            elif hi > lo:
                pairs += [(dst13[lo:hi], w13[lo:hi]), (dst13[F + lo:F + hi], w13[F + lo:F + hi])]
            if fresh:
                pairs.append((dst["w2"], w2))
                if lo > 0:
                    zeros += [dst13[:lo], dst13[F:F + lo]]
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        ev = self.copier.copy(pairs, after, zeros)
        if self.nvme is not None:
            for e, *_ in items:
                self.host_busy[self.host_table.lookup((store.pos, e))] = ev
        stats.bytes_h2d += nbytes
        return ev

    # ------------------------------------------------------------------ life cycle
    def finish_load(self) -> None:
        """After the weights are in: NVMe files to disk, the load maps dropped; the cost model measured."""
        if len(self.stores) != self.shape.num_layers:
            raise RuntimeError(f"{len(self.stores)} offload stores for {self.shape.num_layers} MoE layers")
        if self.nvme is not None:
            self.nvme.sync()
            for store in self.stores:
                store.drop_load_views()
        self.cost = self._measure()
        self.copier.bytes_per_s = self.cost.h2d_bytes_per_s
        self.copier.pending.clear()  # the measurement's copies are done (it synchronized)
        logger.info("%s", self.plan.describe())
        logger.info("%s", self.cost.describe(self.shape.nbytes, self.device.type))
        note = host_threads.start_up_note(self.cfg, self.device.type)
        if note:
            logger.warning("%s", note)

    def _measure(self) -> CostModel:
        store, buf, probe = self.stores[0], self.buffers[0], OffloadStats()
        read_s = None
        if self.nvme is not None:
            t0 = time.perf_counter()
            self.ensure_host(store, [0], "step", probe)
            read_s = time.perf_counter() - t0
        src, dst = self.host_expert(store, 0), buf.slot(0)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        cost = CostModel.measure(self.shape.nbytes, lambda: self.host_weights(store, 0), self.shape.dtype,
                                 lambda: self.copier.copy([(dst[name], t) for name, t in src.items()]), sync)
        if read_s is not None:
            cost.read_bytes_per_s = self.shape.record_bytes / max(read_s, 1e-9)
            self.host_table.unpin_all("step")
        return cost

    def summary(self) -> Dict[str, object]:
        total = OffloadStats()
        for s in self.stats:
            total.add(s)
        return {"plan": self.plan.describe(), "reader": getattr(getattr(self, "reader", None), "name", None),
                "host_threads": host_threads.describe(),
                "cost": self.cost.describe(self.shape.nbytes) if self.cost else None,
                "prefetch_calibration": self.prefetcher.calibration.describe(),
                "total": total.summary(), "layers": [s.summary() for s in self.stats]}

    def reset_stats(self) -> None:
        self.stats = [OffloadStats() for _ in self.stores]

    def close(self) -> None:
        if self.nvme is not None:
            self.reader.close()
            self.nvme.close()
            self.host_region.release()
        for store in self.stores:
            store.release()
