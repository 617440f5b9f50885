"""One offloaded layer step's answer (`OffloadedExpertStore.fetch`): where each expert runs, and running it.

    fetched.run(x_RD, ids_RK, weights_RK, compute)  # any rows (an EP dispatcher's received rows)
    fetched.run_local(x_TD, weights_TK, compute)    # the rows fetch saw (the local dispatcher):
                                                    # slot ids worked out on the host, no id maps launched

Local experts run from their cache slots (slot ids for the fused kernel), from the two stream
buffers (chunks copied under the compute of the previous chunk), or on the host (whole, or the
first gate/up rows of a shared expert, offload/split.py). Every small table of the step goes to the
device in one copy when the answer is built, before any GPU-side wait is queued.

Legend: T tokens, R rows, D hidden, E local experts, S cache slots, K top-k.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import numpy as np
import torch

from moe_infer.offload.compute import CpuRows, SlotCompute, cpu_experts, gather_cpu_rows, to_device


def _eager(compute: SlotCompute, *args) -> torch.Tensor:
    """The device experts launched as they are (offload.expert_graphs off)."""
    return compute(*args)


class FetchedExperts:
    def __init__(self, store, slot_of_E: List[int], waits: list, to_cpu: List[int], shared: Dict[int, int],
                 needed: Dict[int, int], to_stream: List[int], nxt, next_scores,
                 local_N: Optional[np.ndarray] = None) -> None:
        """local_N: the local expert of each of fetch's T*K rows (-1: none), when the local dispatcher will
        run them as they are (`run_local`)."""
        self.planned_at = time.perf_counter()
        dev, E, C = store.w13_S2FD.device, store.num_local_experts, store.manager.plan.stream_chunk
        self.store, self.waits, self.to_cpu, self.to_stream = store, waits, to_cpu, to_stream
        self.shared = shared  # expert -> gate/up rows [0:c) the host computes (the slot has the rest)
        F = store.manager.shape.intermediate_size
        on_host = to_cpu + list(shared)
        self.cpu_rows = [needed[e] for e in on_host]  # routed rows of each expert the host works on
        self.cpu_shares = [None] * len(to_cpu) + [c / F for c in shared.values()]  # None: the whole expert
        self.nxt, self.next_scores = nxt, next_scores
        self.on_device = any(s >= 0 for s in slot_of_E)
        self.w13_S2FD, self.w2_SDF = store.w13_S2FD, store.w2_SDF
        self.chunks = [to_stream[i:i + C] for i in range(0, len(to_stream), C)]
        tables = [slot_of_E, [int(e in to_cpu or e in shared) for e in range(E)]]
        for chunk in self.chunks:
            tables.append([chunk.index(e) if e in chunk else -1 for e in range(E)])
        self.local_N = local_N
        table_XE1 = np.array([t + [-1] for t in tables], dtype=np.int64)
        flat = [table_XE1[:, :E].ravel()]
        if local_N is not None:  # the same tables looked up per row on the host (index E: no expert)
            per_row = table_XE1[:, np.where(local_N >= 0, local_N, E)]
            self.cpu_N = np.flatnonzero(per_row[1] > 0)  # rows the host computes
            flat.append(per_row.ravel())
        tables_XE = to_device(np.concatenate(flat), dev)
        n = len(tables) * E
        tables_XE, rows_XN = tables_XE[:n].view(len(tables), E), tables_XE[n:]
        self.slot_of_E, self.is_cpu_E, self.chunk_slot_of_E = tables_XE[0], tables_XE[1].bool(), tables_XE[2:]
        if local_N is not None:
            rows_XN = rows_XN.view(len(tables), len(local_N))
            self.slot_N, self.chunk_slot_XN = rows_XN[0], rows_XN[2:]

    def run(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
            compute: SlotCompute) -> torch.Tensor:
        """out_TD for rows with local expert ids_TK (-1: none)."""
        valid_TK = ids_TK >= 0
        safe_TK = ids_TK.clamp_min(0).long()
        cpu_t0 = time.perf_counter()
        cpu_rows = gather_cpu_rows(x_TD, ids_TK, weights_TK, self.is_cpu_E) if self.cpu_rows else None
        cpu_s = time.perf_counter() - cpu_t0
        slot_ids_TK = torch.where(valid_TK, self.slot_of_E[safe_TK], -1) if self.on_device else None
        chunk_ids = [torch.where(valid_TK, c_E[safe_TK], -1) for c_E in self.chunk_slot_of_E[:len(self.chunks)]]
        return self._run(x_TD, weights_TK, compute, slot_ids_TK, chunk_ids, cpu_rows, cpu_s)

    def run_local(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, compute: SlotCompute) -> torch.Tensor:
        """`run` on the rows fetch saw, with the slot ids it looked up on the host."""
        if self.local_N is None:
            raise RuntimeError("run_local needs the rows' local experts at fetch (local_N)")
        shape = weights_TK.shape
        cpu_t0 = time.perf_counter()
        cpu_rows = None
        if self.cpu_rows:  # the rows the host computes are known: no search on the device
            K = shape[1]
            t_r, k_r = (self.cpu_N // K).tolist(), (self.cpu_N % K).tolist()
            t_idx = to_device(t_r, x_TD.device)
            cpu_rows = CpuRows(t_idx, x_TD.index_select(0, t_idx).cpu(), self.local_N[self.cpu_N].tolist(),
                               weights_TK[t_idx, to_device(k_r, x_TD.device)].float().cpu())
        cpu_s = time.perf_counter() - cpu_t0
        chunk_ids = [c_N.view(shape) for c_N in self.chunk_slot_XN[:len(self.chunks)]]
        return self._run(x_TD, weights_TK, compute, self.slot_N.view(shape) if self.on_device else None, chunk_ids,
                         cpu_rows, cpu_s)

    def _run(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, compute: SlotCompute,
             slot_ids_TK: Optional[torch.Tensor], chunk_ids: list, cpu_rows: Optional[CpuRows], cpu_s: float
             ) -> torch.Tensor:
        store, m = self.store, self.store.manager
        m.copier.wait(self.waits)  # the GPU waits for the copies it needs; the host does not
        run = m.expert_graphs or _eager  # offload.expert_graphs: replayed as CUDA graphs
        if slot_ids_TK is not None:
            out_TD = run(compute, x_TD, slot_ids_TK, weights_TK, self.w13_S2FD, self.w2_SDF)
        else:
            out_TD = torch.zeros_like(x_TD)
        store.last_compute = m.copier.mark()
        st = m.stats[store.pos]
        for i, chunk in enumerate(self.chunks):  # copy of chunk i+1 queued under the compute of chunk i
            buf = m.buffers[i % 2]
            m.copier.wait([m.copy_experts(store, [(e, buf.slot(j)) for j, e in enumerate(chunk)], [buf.last_use], st)])
            out_TD = out_TD + run(compute, x_TD, chunk_ids[i], weights_TK, buf.w13_C2FD, buf.w2_CDF)
            buf.last_use = m.copier.mark()
        if self.nxt is not None:  # the GPU has its work queued: the link turns to the next layer
            self.nxt.prefetch(self.next_scores)
            self.nxt = None
        if cpu_rows is not None:  # the host computes while the GPU and the link work
            cpu_t0 = time.perf_counter()
            if self.planned_at is not None:  # the step's first host compute (an EP step may run in parts)
                m.note_host_lead(cpu_t0 - self.planned_at - cpu_s)  # cpu_s: the rows out, the CPU path's own cost
                self.planned_at = None
            shared = {e: (c, self.w2_SDF[store.table.lookup(e)]) for e, c in self.shared.items()}
            dtype = cpu_rows.x_rD.dtype  # a quantized expert dequantized on the host, one at a time
            out_TD = cpu_experts(cpu_rows, out_TD, lambda e: m.host_weights(store, e, dtype), shared,
                                 store.expert_act, store.down_bias)
            if m.cost is not None:  # what the CPU path cost the host in this engine, for the next split
                m.cost.observe_cpu(self.cpu_rows, cpu_s + time.perf_counter() - cpu_t0, shares=self.cpu_shares)
        store.last_compute = m.copier.mark()
        m.run_end_s, m.run_end_pos = time.perf_counter(), store.pos
        return out_TD
