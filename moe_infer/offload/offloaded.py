"""The offloading expert store of one MoE layer: a GPU cache of slots in front of the host tier.

    fetched = store.fetch(x_TD, ids_TK)          # right before the experts: which, and where
    out_TD = fetched.run(x_TD, local_ids_TK, weights_TK, compute)

`fetch` pre-gates the next layer on the same hidden state, brings the routed ids and the prediction
to the host in one copy (the layer step's one host sync; counting rows per expert and the
prediction's mass is host arithmetic, not a dozen small launches), then plans the step: hits (cached
or in flight) stay pinned; misses are split by the cost model between the link (copied into a cache
slot, or into the stream buffers when the step needs more than `stream_fraction` of the experts or no
slot is free) and the CPU, or shared between the two (offload/split.py).
`run` / `run_local` (offload/fetched.py) compute on slot ids, issue the next layer's prefetch as soon
as the GPU has its work, stream the rest through the double buffers and add the CPU's rows.

Legend: T tokens, D hidden, F expert intermediate, E local experts, S cache slots, K top-k,
C experts per stream buffer.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from torch import nn

from moe_infer.experts.activation import SILU, ExpertAct
from moe_infer.offload.fetched import FetchedExperts
from moe_infer.offload.host import layer_host_tensors
from moe_infer.offload.nvme import record_views
from moe_infer.offload.policies import CACHE_POLICIES
from moe_infer.offload.slots import SlotTable
from moe_infer.offload.split import plan_misses
from moe_infer.offload.stats import OffloadStats

Router = Callable[[torch.Tensor], tuple]  # x_TD -> (logits_TE, topk_weights_TK, topk_ids_TK)
BIAS_ATTRS = {"b13": "b13_E2F", "b2": "b2_ED"}


def _attr(name: str, w13: str, w2: str) -> str:
    """A layout tensor's attribute name: "w13_scale_inv" -> w13 + "_scale_inv"; the biases under the resident
    store's names (b13_E2F, b2_ED)."""
    if name in BIAS_ATTRS:
        return BIAS_ATTRS[name]
    base = "w13" if name == "w13" or name.startswith("w13_") else "w2"
    return (w13 if base == "w13" else w2) + name[len(base):]


class OffloadedExpertStore(nn.Module):
    is_resident = False

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype, *,
                 manager=None, expert_ids: Optional[List[int]] = None, router: Optional[Router] = None,
                 num_experts: Optional[int] = None, quant=None, bias: bool = False,
                 expert_act: ExpertAct = SILU, down_bias: bool = True, **_) -> None:
        """bias, expert_act, down_bias: GPT-OSS's expert biases (moved with the weights, offload/layout.py), its
        clamped SwiGLU, and whether this rank adds the down bias (moe_tp rank 0)."""
        super().__init__()
        if manager is None:
            raise ValueError("an offloading expert store needs the engine's OffloadManager (MoEBackends.offload)")
        E, shape = num_local_experts, manager.shape
        if quant != shape.quant or bias != shape.bias:
            raise ValueError(f"expert store of format {quant} (biases: {bias}) under an offload plan for "
                             f"{shape.quant} (biases: {shape.bias}) (ExpertShape.quant, .bias)")
        self.expert_act, self.down_bias = expert_act, down_bias
        self.manager, self.num_local_experts, self.router = manager, E, router
        self.pos = manager.register(self)
        cfg = manager.cfg
        layout = shape.layout  # each expert's tensors in the checkpoint's format (offload/layout.py)
        if manager.nvme is None:  # every expert in (pinned) host memory: the loader fills them
            self._region, host = layer_host_tensors(E, layout, manager.pin)
            self.path = None
        else:  # the loader writes through a map of this layer's file; dropped after the load
            self._region = None
            self.path, rec_ER = manager.nvme.layer_file(E)
            host = record_views(rec_ER, shape)
        self.host_tensors = host  # name -> [E, ...] (the CPU tier's copy sources)
        held = {}  # the same tensors under the resident store's names (w13_E2FD, w13_E2FD_scale_inv ...):
        for name, t in host.items():  # the loader's targets, scales as buffers, the data carrying its format
            attr = _attr(name, "w13_E2FD", "w2_EDF")
            if name in ("w13", "w2") or name in BIAS_ATTRS:
                setattr(self, attr, nn.Parameter(t, requires_grad=False))
            else:
                self.register_buffer(attr, t)
            held[name] = getattr(self, attr)
        layout.weights(held)
        S = manager.plan.slots_per_layer[self.pos]
        self.slots = layout.pool(S, manager.device)  # name -> [S, ...]: the cache slots, in the stored format
        # the data of the slots, carrying the format (the kernels take the slot pool as [S, ...] with slot ids);
        # plain attributes, not buffers: the loader reads every `*_scale_inv` buffer as a checkpoint target
        self.w13_S2FD, self.w2_SDF = layout.weights(self.slots)
        ids = list(range(E)) if expert_ids is None else [int(e) for e in expert_ids]
        self.num_experts = num_experts or (max(ids) + 1)
        self.expert_ids_np = np.asarray(ids, dtype=np.int64)  # local expert -> logical id
        self.local_of = np.full(self.num_experts + 1, -1, dtype=np.int64)  # logical id -> local expert (-1: none)
        for i in range(len(ids) - 1, -1, -1):  # the first local copy of a replicated expert
            self.local_of[ids[i]] = i
        self.freq_np = np.zeros(self.num_experts)  # decayed routed rows per logical expert (prefetch_stats_weight)
        self.table = SlotTable(S, CACHE_POLICIES.get(cfg.cache_policy)())
        self.ready: List[object] = [None] * S  # copy event of each slot
        self.missing_S: List[int] = [0] * S  # leading gate/up rows a slot lacks (zero there; offload/split.py)
        self.last_compute = None  # event after this layer's last expert compute
        self.pred_TK: Optional[np.ndarray] = None  # the previous layer's pre-gate for this layer (host)
        self.predicted: Optional[set] = None
        self.prefetched: set = set()
        self.evicted: set = set()  # experts the prefetch for this layer's next step evicted
        self.pending: list = []  # (expert, calibration key) of that prefetch, observed when the step comes
        self.last_needed: set = set()  # experts this layer's previous step needed

    # ------------------------------------------------------------------ fetch
    def predict(self, x_TD: torch.Tensor) -> tuple:
        """This layer's router on another layer's hidden state: predicted ids [T, K] (logical) and their
        weights [T, K] (a router without weights, e.g. a replayed trace: K, K-1, ... 1 over K by rank)."""
        logits_TE, weights_TK, ids_TK = self.router(x_TD)
        alpha = self.manager.cfg.prefetch_stats_weight
        if alpha > 0:
            freq_E = torch.from_numpy(self.freq_np / max(self.freq_np.sum(), 1.0)).to(logits_TE.device, torch.float32)
            scores_TE = (1 - alpha) * logits_TE.float().softmax(-1) + alpha * freq_E
            weights_TK, ids_TK = scores_TE.topk(ids_TK.shape[1], dim=-1)
        if weights_TK is None:
            K = ids_TK.shape[1]
            weights_TK = torch.arange(K, 0, -1, device=ids_TK.device, dtype=torch.float32).div(K).expand(ids_TK.shape)
        return ids_TK, weights_TK

    def fetch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor) -> FetchedExperts:
        m, cfg = self.manager, self.manager.cfg
        m.begin_layer(self)
        N = ids_TK.numel()
        parts = [ids_TK.reshape(-1).float()]  # expert ids are exact in float32
        nxt = m.next_store(self) if cfg.prefetch else None
        if nxt is not None:
            pred_TK, pred_weights_TK = nxt.predict(x_TD)
            parts += [pred_TK.reshape(-1).float(), pred_weights_TK.reshape(-1).float()]
        m.note_host_gap(time.perf_counter(), self.pos)
        host = torch.cat(parts).cpu().numpy()  # the layer step's one host sync; the rest is host arithmetic
        ids_N = host[:N].astype(np.int64)
        rows_all = np.bincount(ids_N[ids_N >= 0], minlength=self.num_experts)  # rows per logical expert
        self.freq_np *= 0.99
        self.freq_np += rows_all
        rows_S = rows_all[self.expert_ids_np]
        needed: Dict[int, int] = {int(e): int(rows_S[e]) for e in np.flatnonzero(rows_S)}
        st = m.stats[self.pos]
        st.layer_steps += 1
        st.needed += len(needed)
        if self.pred_TK is not None and self.pred_TK.shape == tuple(ids_TK.shape):
            ids_TK_np = ids_N.reshape(self.pred_TK.shape)
            st.token_matches += int((self.pred_TK[:, :, None] == ids_TK_np[:, None, :]).any(-1).sum())
            st.token_slots += N
        if self.predicted is not None:
            st.predicted += len(self.predicted)
            st.predicted_needed += len(self.predicted & needed.keys())
            st.needed_after_prediction += len(needed)
        m.prefetcher.observe(self.pending, needed)
        st.prefetch_evicted_needed += len(self.evicted & needed.keys())
        self.predicted, self.pred_TK, self.pending, self.evicted = None, None, [], set()
        self.last_needed = set(needed)
        next_scores = None
        if nxt is not None:
            P = pred_TK.numel()
            nxt.pred_TK = host[N:N + P].astype(np.int64).reshape(tuple(pred_TK.shape))
            next_scores = nxt._scores(nxt.pred_TK.reshape(-1), host[N + P:N + 2 * P])
        local_N = self.local_of[np.where((ids_N >= 0) & (ids_N < self.num_experts), ids_N, self.num_experts)]
        return self._plan(needed, st, nxt, next_scores, local_N)

    def _scores(self, pred_P: np.ndarray, weights_P: np.ndarray) -> List[int]:
        """Predicted routing mass per local expert [E] as integers (units of 2^-16, rounded up: a picked
        expert never scores 0): the order prefetches take."""
        mass = np.bincount(pred_P, weights=np.clip(weights_P, 0.0, None), minlength=self.num_experts)
        return np.ceil(mass[self.expert_ids_np].astype(np.float32) * np.float32(65536.0)).astype(np.int64).tolist()

    def _plan(self, needed: Dict[int, int], st: OffloadStats, nxt, next_scores, local_N: np.ndarray) -> FetchedExperts:
        m, cfg, E, table = self.manager, self.manager.cfg, self.num_local_experts, self.table
        table.unpin_all("prefetch")  # the prefetch was for this step
        table.policy.observe(needed)
        cached = [e for e in needed if table.lookup(e) is not None]
        m.step_pinned.add(self)  # before the pins: a step that fails part-way still has them released
        for e in needed:
            table.pin(e, "step")
        for e in cached:
            table.touch(e)
        partial = {e: (needed[e], self.missing_S[table.lookup(e)]) for e in cached
                   if self.missing_S[table.lookup(e)]}
        st.hits += len(cached) - len(partial)
        st.partial += len(partial)
        used = len(self.prefetched.intersection(cached))
        st.prefetch_hits += used
        st.prefetch_wasted += len(self.prefetched) - used
        st.bytes_prefetch_wasted += (len(self.prefetched) - used) * m.shape.nbytes
        self.prefetched = set()
        misses = {e: n for e, n in needed.items() if table.lookup(e) is None}
        m.ensure_host(self, list(misses) + list(partial), "step", st)
        stream_all = len(needed) > cfg.stream_fraction * E
        # streamed, quantized (rows share scale blocks) or with biases / another activation (the host's share of
        # rows is plain SwiGLU): whole experts only, no misses shared by rows
        whole = stream_all or m.shape.layout.is_quantized or m.shape.bias or self.expert_act != SILU
        mode = "auto" if whole and cfg.miss_policy == "share" else cfg.miss_policy
        link_wait_s = m.link_wait_s() - (m.host_gap_s if mode == "share" else 0.0)
        plan = plan_misses(misses, partial, mode, m.cost, m.shape, link_wait_s, m.host_lead_s)
        if misses and mode in ("auto", "share") and not plan.to_cpu and not any(plan.shared.values()):
            m.cost.relax()  # the host got nothing: its slow figure, if any, must not stick (cost.py)
            m.relax_host_lead()  # nor a long lead
        F = m.shape.intermediate_size
        to_stream, to_cpu, shared, copies = [], list(plan.to_cpu), {}, []
        for e in plan.to_copy + [e for e in plan.shared if e in misses]:
            got = None if stream_all else table.allocate(e)
            c = plan.shared.get(e, 0)
            if got is None:  # no free or evictable slot: whole, streamed or (mostly the host's anyway) on the host
                (to_cpu if 2 * c > F else to_stream).append(e)
                continue
            self.missing_S[got[0]] = c
            copies.append((e, self.slot(got[0]), c, F, True))
            if c:
                shared[e] = c
        for e, (_, missing) in partial.items():
            c = plan.shared[e]
            slot = table.lookup(e)
            self.missing_S[slot] = c
            if c < missing:
                copies.append((e, self.slot(slot), c, missing, False))
            if c:
                shared[e] = c
        self._copy_into_slots(copies, st)
        st.copied += sum(1 for e in plan.to_copy if e not in to_stream and e not in to_cpu)
        st.shared += sum(1 for e in shared if e in misses)
        row = m.shape.w13_numel / (m.shape.w13_numel + m.shape.w2_numel) / F  # one gate/up row, in experts of bytes
        st.cpu_shared += row * sum(shared.values())
        st.partial_missing += row * sum(missing for _, missing in partial.values())
        st.streamed += len(to_stream)
        st.cpu += len(to_cpu)
        elsewhere = set(to_cpu) | set(to_stream)
        slot_of_E = [-1] * E
        for e in needed:
            if e not in elsewhere:
                slot_of_E[e] = table.lookup(e)
        waits = [self.ready[slot_of_E[e]] for e in needed if slot_of_E[e] >= 0]
        return FetchedExperts(self, slot_of_E, waits, to_cpu, shared, needed, to_stream, nxt, next_scores, local_N)

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, scores: List[int]) -> None:
        """Bring what the previous layer's pre-gate predicted for this layer, as the prefetch rule decides
        (offload/prefetch.py) among the top `max_prefetch` predictions (`_scores_S`: the most mass first)."""
        m, cfg, table = self.manager, self.manager.cfg, self.table
        want = sorted((e for e, n in enumerate(scores) if n), key=lambda e: (-scores[e], e))
        self.predicted = set(want)
        if len(want) > cfg.stream_fraction * self.num_local_experts:
            return  # this layer will stream its step: nothing to cache ahead
        limit = table.num_slots if cfg.max_prefetch is None else min(cfg.max_prefetch, table.num_slots)
        st = m.stats[self.pos]
        uncached = [e for e in want if table.lookup(e) is None]
        evictable = sorted(table.evictable(), key=table.policy.rank)  # coldest first
        choices, self.pending = m.prefetcher.decide(want, scores, table.slot_of, evictable, len(table.free),
                                                    self.last_needed, len(set(want[:limit]) & set(uncached)))
        victims = {v for _, v in choices}
        for e in [e for e in want[:limit] if e not in victims] + [e for e, _ in choices]:
            table.pin(e, "prefetch")
        m.ensure_host(self, [e for e, _ in choices], "prefetch", st)
        copies = []
        for e, victim in choices:
            got = table.allocate(e, victim)
            if got is None:
                break
            copies.append((e, self.slot(got[0]), 0, m.shape.intermediate_size, True))
            self.missing_S[got[0]] = 0
            self.prefetched.add(e)
            if got[1] is not None:
                self.evicted.add(got[1])
        st.prefetched += len(copies)
        st.prefetch_declined += len(uncached) - len(copies)
        self._copy_into_slots(copies, st)

    def biases(self) -> tuple:
        """(b13_E2F, b2_ED) of every local expert in the host tier, or (None, None) (the device's are the slots')."""
        return getattr(self, "b13_E2F", None), getattr(self, "b2_ED", None)

    def slot(self, s: int) -> Dict[str, torch.Tensor]:
        """Slot s's tensors (name -> one expert's), what a copy fills."""
        return {name: t[s] for name, t in self.slots.items()}

    def _copy_into_slots(self, copies: list, st: OffloadStats) -> None:
        """One batch of copies into this layer's slots (manager.copy_rows items), after this layer's last
        compute read them."""
        ev = self.manager.copy_rows(self, copies, [self.last_compute], st)
        for e, *_ in copies:
            self.ready[self.table.lookup(e)] = ev

    # ------------------------------------------------------------------ life cycle
    def drop_load_views(self) -> None:
        """NVMe: the file maps the loader wrote through are no longer needed."""
        for name in self.host_tensors:
            delattr(self, _attr(name, "w13_E2FD", "w2_EDF"))
        self.host_tensors = None

    def release(self) -> None:
        """Engine shutdown: the host tier is unlocked and given back (the store is unusable after)."""
        if self._region is not None:
            self._region.release()
            self._region = None
            for name in self.host_tensors:
                setattr(self, _attr(name, "w13_E2FD", "w2_EDF"), None)
            self.host_tensors = None
