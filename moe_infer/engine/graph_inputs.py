"""The integer inputs of a CUDA-graph step, padding included, in one persistent device buffer written by
one host-to-device copy.

A captured graph reads its inputs from fixed addresses. Copying a step's inputs there tensor by tensor
took 14 small launches per prefill step (ids, positions, KV slots, the padding mask, block tables,
sequence lengths, query starts, and the padding of each), plus the int32 cast of the step's flat buffer:
host time before the graph's launch, on the critical path of every prompt's first token. Instead the host
lays the step out exactly as the bucket's graph reads it (numpy, padding written there too) and one copy
moves it.

Layout of a bucket (Tp rows, Bp sequences, table width M), in bytes, every segment 16-byte aligned
(Triton specializes kernels on pointer alignment):

    ids int64 [Tp] | positions int64 [Tp] | slots int64 [Tp] | query starts int32 [Bp + 1]
    | seq lens int32 [Bp] | block tables int32 [Bp, M] | valid bool [Tp] | sample rows int64 [S] | extra int64 [X]

The graph-read segments come first, so their offsets depend on (Tp, Bp, M) only: every bucket's graph bakes
in its own offsets into the one buffer. Steps run one after another on one stream, so a step's copy lands
after the kernels of the step before have read their inputs.

Legend: T tokens of the step, Tp padded, B sequences, Bp padded, M table width, S sampling rows, X extra.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np
import torch

_ALIGN = 16
# (name, numpy dtype, torch dtype): the segments in buffer order; counts come from `layout`
_SEGMENTS = (("ids", np.int64, torch.int64), ("positions", np.int64, torch.int64), ("slots", np.int64, torch.int64),
             ("query_starts", np.int32, torch.int32), ("seq_lens", np.int32, torch.int32),
             ("block_tables", np.int32, torch.int32), ("valid", np.bool_, torch.bool),
             ("sample_rows", np.int64, torch.int64), ("extra", np.int64, torch.int64))

_TORCH_DTYPES = {name: dt for name, _, dt in _SEGMENTS}


@dataclass(frozen=True)
class Layout:
    """Byte offset and element count of each segment of one step's buffer (`layout`)."""

    rows: int  # Tp
    seqs: int  # Bp
    width: int  # M
    segments: Dict[str, Tuple[int, int]]  # name -> (byte offset, elements)
    nbytes: int

    def host_views(self, host: np.ndarray) -> Dict[str, np.ndarray]:
        """numpy views of the segments of a uint8 host buffer (block tables as [Bp, M])."""
        views = {name: host[off:off + n * np.dtype(dt).itemsize].view(dt)
                 for (name, dt, _), (off, n) in zip(_SEGMENTS, self.segments.values())}
        views["block_tables"] = views["block_tables"].reshape(self.seqs, self.width)
        return views

    def device_view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """One segment of the device buffer (block tables as [Bp, M])."""
        (off, n), dt = self.segments[name], _TORCH_DTYPES[name]
        view = buf[off:off + n * dt.itemsize].view(dt)
        return view.view(self.seqs, self.width) if name == "block_tables" else view

    def device_views(self, buf: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Every segment of the device buffer."""
        return {name: self.device_view(buf, name) for name in self.segments}


def layout(rows: int, seqs: int, width: int, sample_rows: int = 0, extra: int = 0) -> Layout:
    counts = (rows, rows, rows, seqs + 1, seqs, seqs * width, rows, sample_rows, extra)
    segments, at = {}, 0
    for (name, dt, _), n in zip(_SEGMENTS, counts):
        segments[name] = (at, n)
        at += -(-n * np.dtype(dt).itemsize // _ALIGN) * _ALIGN
    return Layout(rows, seqs, width, segments, at)


class GraphInputs:
    """The persistent device buffer, sized for the largest bucket (rows, seqs) at table width `width`, with
    up to `seqs` sampling rows and 2 * seqs extra entries."""

    def __init__(self, rows: int, seqs: int, width: int, device: torch.device) -> None:
        self.width = width
        self.max_sample, self.max_extra = seqs, 2 * seqs
        self.buffer = torch.zeros(layout(rows, seqs, width, self.max_sample, self.max_extra).nbytes,
                                  dtype=torch.uint8, device=device)

    def layout(self, rows: int, seqs: int, sample_rows: int = 0, extra: int = 0) -> Layout:
        if sample_rows > self.max_sample or extra > self.max_extra:
            raise ValueError(f"a step with {sample_rows} sampling rows and {extra} extra entries does not fit the "
                             f"graph input buffer (at most {self.max_sample} and {self.max_extra})")
        return layout(rows, seqs, self.width, sample_rows, extra)

    def views(self, lay: Layout) -> Dict[str, torch.Tensor]:
        return lay.device_views(self.buffer)

    def load(self, host: np.ndarray) -> None:
        """One copy of a host buffer built on a `layout` into the device buffer (stream-ordered)."""
        if host.dtype != np.uint8 or host.nbytes > self.buffer.numel():
            raise ValueError(f"host buffer {host.dtype} of {host.nbytes} bytes does not fit {self.buffer.numel()}")
        self.buffer[:host.nbytes].copy_(torch.from_numpy(host), non_blocking=True)
