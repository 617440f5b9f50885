"""The static inputs of the decode graphs: views of one device buffer that one host-to-device copy fills.

A captured decode graph reads its inputs from fixed addresses. Filling them tensor by tensor from the step's
own device tensors took seven copies and fills per step, plus the step's own H2D copy and the slicing of
it: GPU work between two replays (each a launch gap) and host time (on an H100, `prepare` and the graph's
`run` took 0.35 ms of host time a batch-1 step, against 0.76 ms of GPU work; benchmarks/trials/step_breakdown.py).
Instead the host writes the step, padding included, into a pinned staging buffer laid out as the device
buffer, and one copy moves the bytes the step's bucket reads.

Layout (bytes; every segment 16-byte aligned), fixed for the largest batch Bmax and the table width M:

    ids int64 [Tmax] | positions int64 [Tmax] | slots int64 [Tmax] | sample rows int64 [Tmax]
    | query starts int32 [Bmax + 1] | seq lens int32 [Bmax] | valid bool [Tmax] | extra int64 [2 Bmax]
    | block tables int32 [Bmax, M]

Tmax = Bmax for plain decode steps (one query token a sequence); speculative verify steps (q = k + 1 query
tokens every sequence) need Tmax = the most sequences of such a step times q. A step padded to Bp sequences
copies everything before the tables and Bp rows of them. The query starts (0..Bmax: one query token a
sequence) are written once, in both staging buffers and on the device; a verify step writes its own (0, q, 2q..).

Two staging buffers are used in turn (`graph_inputs.PinnedStaging`, shared with the prefill graphs' inputs, which
lay out each bucket on its own).

Legend: B sequences of the step (one token each), Bp padded, Bmax largest, M table width, X extra entries.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from moe_infer.engine.graph_inputs import PinnedStaging

_ALIGN = 16
# (name, numpy dtype, torch dtype, elements as a function of (Bmax, Tmax)); the block tables come last (M per row)
_SEGMENTS = (("ids", np.int64, torch.int64, lambda b, t: t), ("positions", np.int64, torch.int64, lambda b, t: t),
             ("slots", np.int64, torch.int64, lambda b, t: t), ("sample_rows", np.int64, torch.int64, lambda b, t: t),
             ("query_starts", np.int32, torch.int32, lambda b, t: b + 1),
             ("seq_lens", np.int32, torch.int32, lambda b, t: b),
             ("valid", np.bool_, torch.bool, lambda b, t: t), ("extra", np.int64, torch.int64, lambda b, t: 2 * b))


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class DecodeBuffers:
    """`dev[name]`: the device views (block tables as [Bmax, M]); `stage()` -> the host views of the staging
    buffer the next `load(Bp)` copies."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device, max_tokens: int = 0) -> None:
        """max_tokens: the most query rows of a step (speculative verify steps: several a sequence); at least
        max_batch."""
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.max_tokens = max(max_tokens, max_batch)
        offsets, at = {}, 0
        for name, np_dt, _, count in _SEGMENTS:
            offsets[name] = (at, count(max_batch, self.max_tokens))
            at += _aligned(count(max_batch, self.max_tokens) * np.dtype(np_dt).itemsize)
        self.tables_at, self.offsets = at, offsets
        nbytes = at + max_batch * max_blocks * 4
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.dev: Dict[str, torch.Tensor] = {
            name: self.buffer[off:off + n * t_dt.itemsize].view(t_dt)
            for (name, _, t_dt, _), (off, n) in zip(_SEGMENTS, offsets.values())}
        self.dev["block_tables"] = self.buffer[at:].view(torch.int32).view(max_batch, max_blocks)
        self._staging = PinnedStaging(self.buffer)
        self._host: List[Dict[str, np.ndarray]] = []
        for staging in self._staging.host:
            host = staging.numpy()
            views = {name: host[off:off + n * np.dtype(np_dt).itemsize].view(np_dt)
                     for (name, np_dt, _, _), (off, n) in zip(_SEGMENTS, offsets.values())}
            views["block_tables"] = host[at:].view(np.int32).reshape(max_batch, max_blocks)
            views["query_starts"][:] = np.arange(max_batch + 1, dtype=np.int32)
            self._host.append(views)
        self.dev["query_starts"].copy_(torch.arange(max_batch + 1, dtype=torch.int32))
        self.dev["slots"].fill_(-1)
        self.dev["seq_lens"].fill_(1)

    def host_views(self, host: np.ndarray, padded_batch: int) -> Dict[str, np.ndarray]:
        """numpy views, laid out as the device buffer, of the first nbytes(padded_batch) bytes of a uint8 host array
        (block tables as [padded_batch, M]; query starts not written: the caller writes every element)."""
        views = {name: host[off:off + n * np.dtype(np_dt).itemsize].view(np_dt)
                 for (name, np_dt, _, _), (off, n) in zip(_SEGMENTS, self.offsets.values())}
        at = self.tables_at
        views["block_tables"] = host[at:at + padded_batch * self.max_blocks * 4].view(np.int32).reshape(
            padded_batch, self.max_blocks)
        return views

    def stage(self) -> Dict[str, np.ndarray]:
        """The host views of the staging buffer the next `load` copies. Its bytes are an earlier step's: the caller
        writes every element its bucket reads."""
        return self._host[self._staging.next()]

    def nbytes(self, padded_batch: int) -> int:
        """Bytes a step padded to padded_batch rows reads: the segments and its rows of the block tables."""
        return self.tables_at + padded_batch * self.max_blocks * 4

    def load(self, padded_batch: int) -> None:
        """One copy (stream-ordered) of the staged segments and the first padded_batch rows of the block tables."""
        n = self.nbytes(padded_batch)
        self._staging.copy(self._staging.host[self._staging.turn][:n], self.buffer[:n])
