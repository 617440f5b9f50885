"""A step's inputs under attention data parallelism: one segment per attention replica, the same shape in each.

With `parallel.dp_attention` each attention replica of a stage runs its own requests (moe_infer/engine/
dp_scheduler.py), but every rank of the stage must replay the same graph bucket and its MoE layers gather
equally many rows from every replica. So the driver pads every replica's part of the plan to the same sizes
(`dp_lay_out`): T rows and B sequences (padding sequences of one row each, or several rows in the last one, that
write no KV slot and read block 0, left out of the expert-load statistics), S sampling rows (padding rows point at
row 0, never read), the same table width. Then the step's device bytes are dp segments of one layout, replica r's
at byte r * n (n: the bytes the path's bucket reads, `region`):

    decode / prefill graphs   the driver writes each replica's segment into one pinned staging buffer as the
                              path's `load` does (its `stage_step`), one host-to-device copy into the DP buffer;
                              every rank of the first stage broadcasts the dp * n bytes (the graphs' prologue)
                              and copies its replica's segment into the path's own buffer, where the graphs read it
    eager                     the dp flat buffers of `flat_inputs`' layout, one after the other; each rank slices
                              its own

The host message (the header) is the one of a single replica's step (its sizes) with the payload's dp * n
bytes. The driver also copies, behind the segments, what only it reads: the placeholder rows of async scheduling
as word indices into the step's buffer (`words`: replica r's ids start at word r * n / 8), the rows of the
gathered sampling rows that are real, and their input ids' words (`DPRows`).

Legend: T rows of a replica's segment, B sequences, S sampling rows, M table width, R placeholder rows,
n segment bytes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from moe_infer.engine.graph_inputs import PinnedStaging
from moe_infer.engine.sequence import SchedulerOutput
from moe_infer.engine.step_inputs import Sizes, StepInputs, flat_inputs, host_segments, placeholder_rows
from moe_infer.engine.step_paths import StepPaths
from moe_infer.parallel.step_message import PATH_DECODE_GRAPH, PATH_EAGER


@dataclass(frozen=True)
class DPStep:
    """The driver's step, laid out per replica with common sizes (`dp_lay_out`)."""

    flats: List[np.ndarray]  # per replica, `flat_inputs`' layout at the common sizes, no extra entries
    sizes: Sizes  # common to every replica
    fills: List[Tuple[List[int], List[int]]]  # per replica: its placeholder rows, their tokens' index in prev's sample
    sample_rows: List[np.ndarray]  # per replica: the rows of its real sampling sequences (plan order)

    @property
    def num_extra(self) -> int:
        return 2 * sum(len(rows) for rows, _ in self.fills)


@dataclass(frozen=True)
class DPRows:
    """What a rank's step under attention data parallelism carries beside its replica's inputs."""

    copy_in: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (segment, path buffer): copied before the forward
    sel_S: Optional[torch.Tensor] = None  # the driver: the real rows of the gathered [dp * S, ...] sampling rows
    ids_S: Optional[torch.Tensor] = None  # the driver: the words of those rows' input ids in `words`
    words: Optional[torch.Tensor] = None  # the driver: the step's device bytes as int64


def _pad_rows(T_r: List[int], B_r: List[int], decode: bool) -> Tuple[int, int, List[List[int]]]:
    """(T, B, per replica the rows of each padding sequence): every replica brought to T rows in B sequences."""
    B = max(max(B_r), 1)
    if decode:  # one row a sequence stays a decode step
        return B, B, [[1] * (B - b) for b in B_r]
    T = max(t + B - b for t, b in zip(T_r, B_r))
    if any(b == B and t < T for t, b in zip(T_r, B_r)):  # rows to add and no sequence to hold them
        B += 1
        T = max(t + B - b for t, b in zip(T_r, B_r))
    pads = []
    for t, b in zip(T_r, B_r):
        k, rows = B - b, T - t
        pads.append([] if k == 0 else [1] * (k - 1) + [rows - (k - 1)])
    return T, B, pads


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def dp_lay_out(parts: List[SchedulerOutput], block_size: int, prev=None) -> DPStep:
    """Each replica's part of the plan in `flat_inputs`' layout, padded to common sizes (the module docstring)."""
    segs, fills = [], []
    for part in parts:
        if part.seqs:
            flat, sizes = flat_inputs(part, block_size)
            segs.append((host_segments(flat, sizes), sizes))
        else:
            segs.append((None, (0, 0, 0, 0, 0, 0)))
        fills.append(placeholder_rows(part, prev))
    T_r = [s[1][0] for s in segs]
    B_r = [s[1][1] for s in segs]
    decode = all(len(s.token_ids) == 1 for part in parts for s in part.seqs)
    T, B, pads = _pad_rows(T_r, B_r, decode)
    S = max(s[1][2] for s in segs)
    M = max([s[1][3] for s in segs] + [-(-n // block_size) for p in pads for n in p] + [1])
    max_q = max([s[1][4] for s in segs] + [n for p in pads for n in p])
    max_seq = max([s[1][5] for s in segs] + [n for p in pads for n in p])
    flats, sample_rows = [], []
    for (src, sizes), pad in zip(segs, pads):
        t, b, s, m = sizes[:4]
        empty = np.zeros(0, dtype=np.int64)
        pad_T = T - t
        ids = np.concatenate([src.ids_T if src else empty, np.zeros(pad_T, dtype=np.int64)])
        positions = np.concatenate([src.positions_T if src else empty] + [np.arange(n, dtype=np.int64) for n in pad])
        slots = np.concatenate([src.slots_T if src else empty, np.full(pad_T, -1, dtype=np.int64)])
        rows_S = src.sample_rows_S if src else empty
        samples = np.concatenate([rows_S, np.zeros(S - s, dtype=np.int64)])
        query_start = np.concatenate([src.query_start_B1 if src else np.zeros(1, dtype=np.int64),
                                      t + np.cumsum(np.asarray(pad, dtype=np.int64))])
        seq_lens = np.concatenate([src.seq_lens_B if src else empty, np.asarray(pad, dtype=np.int64)])
        tables = np.full((B, M), -1, dtype=np.int64)
        if src:
            tables[:b, :m] = src.block_tables_BM
        for j, n in enumerate(pad):  # a padding sequence reads block 0 (zero-filled or written K/V: finite)
            tables[b + j, :-(-n // block_size)] = 0
        flats.append(np.concatenate([
            ids, positions, slots, samples, query_start, np.zeros(_pad4(B + 1) - B - 1, dtype=np.int64),
            seq_lens, np.zeros(_pad4(B) - B, dtype=np.int64), tables.reshape(-1)]))
        sample_rows.append(np.array(rows_S))
    return DPStep(flats, (T, B, S, M, max_q, max_seq), fills, sample_rows)


class DPPaths:
    """`StepPaths` for a rank of a stage with attention data parallelism (the module docstring): the same calls,
    dp segments in the payload, this rank's replica's segment in its inputs."""

    def __init__(self, paths: StepPaths, num_replicas: int, replica: int, max_seqs: int) -> None:
        self.paths, self.dp, self.replica = paths, num_replicas, replica
        self.device = paths.device
        # the segments, then the driver's words: 2 per placeholder row and per sampling row of every replica
        self.max_words = 4 * num_replicas * max(max_seqs, 1) + 16
        self.buffer: Optional[torch.Tensor] = None
        self._staging: Optional[PinnedStaging] = None
        self._sized_for: Optional[tuple] = None
        self._ensure_buffer()  # now, not inside a graph capture (the prologue reads it)

    def _ensure_buffer(self) -> None:
        """The DP buffer for the paths' graphs (sized again only where a test swapped them after start-up)."""
        graphs, eg = self.paths.graphs, self.paths.extend_graphs
        if self._sized_for == (id(graphs), id(eg)):
            return
        region = 0
        if graphs is not None:
            region = graphs.payload_region(graphs.max_batch).numel()
        if eg is not None:
            region = max(region, eg.payload_region(eg.max_tokens, eg.max_seqs).numel())
        self.buffer = (torch.zeros(self.dp * region + 8 * self.max_words, dtype=torch.uint8, device=self.device)
                       if region else None)
        self._staging = PinnedStaging(self.buffer) if self.buffer is not None else None
        self._sized_for = (id(graphs), id(eg))

    # ---- what StepPaths answers alike ---------------------------------------------------------------------------
    def choose(self, sizes: Sizes) -> int:
        return self.paths.choose(sizes)

    def broadcasts_inside(self, path: int) -> bool:
        return self.paths.broadcasts_inside(path)

    def hidden_input(self, path: int, inputs: StepInputs, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        return self.paths.hidden_input(path, inputs, hidden_size, dtype)

    def prologue(self, region_U: torch.Tensor, broadcast) -> None:
        """The graphs' first node on the first stage: the driver's dp segments to every rank, this replica's into the
        path's buffer (region_U: the bytes its bucket reads, n)."""
        n = region_U.numel()
        broadcast(self.buffer[:self.dp * n])
        region_U.copy_(self.buffer[self.replica * n:(self.replica + 1) * n])

    # ---- the path's buffer ----------------------------------------------------------------------------------------
    def region(self, path: int, sizes: Sizes) -> torch.Tensor:
        """The bytes of the path's buffer a step of these sizes reads (what its graphs' prologue gets)."""
        if path == PATH_DECODE_GRAPH:
            g = self.paths.graphs
            return g.payload_region(g._bucket_of(*g._bucket_args(sizes))[0])
        eg = self.paths.extend_graphs
        Tp, Bp, _ = eg.bucket(sizes)
        return eg.payload_region(Tp, Bp)

    def _own_inputs(self, path: int, sizes: Sizes) -> StepInputs:
        owner = self.paths.graphs if path == PATH_DECODE_GRAPH else self.paths.extend_graphs
        return owner.receive(sizes, 0, lambda _bytes: None)[0]

    def _stage_segment(self, path: int, host: np.ndarray, flat: np.ndarray, sizes: Sizes) -> None:
        """A replica's segment, as the path's `load` stages it, padding rows marked as such (slot -1: invalid)."""
        T = sizes[0]
        if path == PATH_DECODE_GRAPH:
            g = self.paths.graphs
            v = g.bufs.host_views(host, g._bucket_of(*g._bucket_args(sizes))[0])
            v["query_starts"][:] = np.arange(v["query_starts"].shape[0], dtype=np.int32)
            g.stage_step(v, flat, sizes, 0)
        else:
            eg = self.paths.extend_graphs
            Tp, Bp, _ = eg.bucket(sizes)
            v = eg.inputs.layout(Tp, Bp, sizes[2], 0).host_views(host)
            eg.stage_step(v, flat, sizes)
        v["valid"][:T] = v["slots"][:T] >= 0

    # ---- the driver ---------------------------------------------------------------------------------------------
    def load(self, path: int, step: DPStep, sizes: Sizes, num_extra: int
             ) -> Tuple[StepInputs, Tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The driver's `StepPaths.load`: every replica's segment to the device in one copy -> (its replica's inputs,
        (placeholder word indices, their tokens' index in the step before's sample), the payload: dp segments)."""
        S = sizes[2]
        if path == PATH_EAGER:
            n8 = step.flats[0].size
            words = self._words(step, n8, S)
            host = np.concatenate(step.flats + [words])
            dev = torch.from_numpy(host).to(self.device, non_blocking=True)
            own = dev[self.replica * n8:(self.replica + 1) * n8]
            inputs = self.paths._eager(own, sizes, 0)[0]
            payload, extra_W, copy_in = dev[:self.dp * n8].view(torch.uint8), dev[self.dp * n8:], None
            words_dev = dev
        else:
            self._ensure_buffer()
            region = self.region(path, sizes)
            n = region.numel()
            words = self._words(step, n // 8, S)
            if words.size > self.max_words:
                raise RuntimeError(f"a step of {words.size} driver words does not fit the DP buffer")
            host = self._staging.host[self._staging.next()].numpy()
            for r, flat in enumerate(step.flats):
                self._stage_segment(path, host[r * n:(r + 1) * n], flat, sizes)
            end = self.dp * n + 8 * words.size
            host[self.dp * n:end].view(np.int64)[:] = words
            self._staging.copy(self._staging.host[self._staging.turn][:end], self.buffer[:end])
            inputs = self._own_inputs(path, sizes)
            payload = self.buffer[:self.dp * n]
            extra_W = self.buffer[self.dp * n:end].view(torch.int64)
            own = self.buffer[self.replica * n:(self.replica + 1) * n]
            copy_in = None if self.broadcasts_inside(path) else (own, region)
            words_dev = self.buffer.view(torch.int64)
        R = num_extra // 2
        num_real = sum(len(rows) for rows in step.sample_rows)
        fill_W = extra_W[:2 * R]
        sel_S, ids_S = extra_W[2 * R:2 * R + num_real], extra_W[2 * R + num_real:2 * R + 2 * num_real]
        dp = DPRows(copy_in=copy_in, sel_S=sel_S, ids_S=ids_S, words=words_dev)
        return dataclasses.replace(inputs, dp=dp), fill_W, payload

    def _words(self, step: DPStep, seg_words: int, S: int) -> np.ndarray:
        """The driver's words behind the segments: placeholder rows (word indices) | their sources | the real rows of
        the gathered sampling rows | their input ids' word indices."""
        rows = [r * seg_words + row for r, (rs, _) in enumerate(step.fills) for row in rs]
        src = [s for _, ss in step.fills for s in ss]
        sel = [r * S + i for r, rs in enumerate(step.sample_rows) for i in range(len(rs))]
        ids = [r * seg_words + int(row) for r, rs in enumerate(step.sample_rows) for row in rs]
        return np.asarray(rows + src + sel + ids, dtype=np.int64)

    # ---- every other rank ---------------------------------------------------------------------------------------
    def receive(self, path: int, sizes: Sizes, num_extra: int, num_bytes: int, fill
                ) -> Tuple[StepInputs, torch.Tensor, torch.Tensor]:
        """The driver's `load`, received: fill (the transfer, None where the graphs' prologue does it) writes the dp
        segments; this replica's is the rank's inputs -> (inputs, no extra entries, the dp segments' bytes)."""
        if num_bytes % self.dp:
            raise RuntimeError(f"a payload of {num_bytes} bytes for {self.dp} attention replicas")
        n = num_bytes // self.dp
        none = torch.empty(0, dtype=torch.int64, device=self.device)
        if path == PATH_EAGER:
            if fill is None:
                raise RuntimeError("an eager step's inputs must be received before its forward")
            buf = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            fill(buf)
            own = buf[self.replica * n:(self.replica + 1) * n].view(torch.int64)
            return self.paths._eager(own, sizes, 0)[0], none, buf
        self._ensure_buffer()
        region = self.region(path, sizes)
        if region.numel() != n:
            raise RuntimeError(f"a replica's step segment takes {n} bytes on the driver and {region.numel()} here "
                               f"(path {path}, sizes {sizes}): the ranks' buffers differ (same configuration?)")
        if fill is not None:
            fill(self.buffer[:num_bytes])
            region.copy_(self.buffer[self.replica * n:(self.replica + 1) * n])
        return self._own_inputs(path, sizes), none, self.buffer[:num_bytes]


def fill_placeholders_dp(inputs: StepInputs, fill_W: torch.Tensor, token_ids_B: torch.Tensor) -> None:
    """Async scheduling on the driver: rows whose input the step before samples, in every replica's segment (word
    indices into the step's buffer), before the segments leave."""
    if fill_W.numel() == 0:
        return
    rows_R, src_R = fill_W.split(fill_W.numel() // 2)
    # the indices lie in the buffer written to: a copy of them (a few words) keeps the write off its own index
    inputs.dp.words.index_copy_(0, rows_R.clone(), token_ids_B.index_select(0, src_R))
