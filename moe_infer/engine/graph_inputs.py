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

The host side is two staging buffers, pinned on CUDA and used in turn (`stage`, then `load`): a copy from
pageable memory costs more host time (the driver stages it itself) and a new numpy buffer per step would be
zeroed and viewed anew. A staging buffer is written again only after its previous copy has finished (an
event per buffer); the numpy views of each layout and the copy's slices are made once.

Legend: T tokens of the step, Tp padded, B sequences, Bp padded, M table width, S sampling rows, X extra.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

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

    @property
    def key(self) -> Tuple[int, ...]:
        """Equal for equal layouts (a Layout itself is not hashable: its segments are a dict)."""
        return (self.rows, self.seqs, self.width, self.segments["sample_rows"][1], self.segments["extra"][1])

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


@functools.lru_cache(maxsize=4096)
def layout(rows: int, seqs: int, width: int, sample_rows: int = 0, extra: int = 0) -> Layout:
    """The segments of a step of `rows` padded rows and `seqs` padded sequences (cached: a Layout is not
    to be changed)."""
    counts = (rows, rows, rows, seqs + 1, seqs, seqs * width, rows, sample_rows, extra)
    segments, at = {}, 0
    for (name, dt, _), n in zip(_SEGMENTS, counts):
        segments[name] = (at, n)
        at += -(-n * np.dtype(dt).itemsize // _ALIGN) * _ALIGN
    return Layout(rows, seqs, width, segments, at)


class PinnedStaging:
    """Two host staging buffers of a device buffer's size (pinned on CUDA), used in turn: `next()` is the one the
    next `copy` reads, once its previous copy has finished (an event each); `copy` moves bytes of it, stream-ordered."""

    def __init__(self, device_buffer: torch.Tensor) -> None:
        self.host = [torch.zeros(device_buffer.numel(), dtype=torch.uint8, pin_memory=device_buffer.is_cuda)
                     for _ in range(2)]
        self._on_cuda = device_buffer.is_cuda
        self._copied: List[Optional[torch.cuda.Event]] = [None, None]  # the last copy out of each staging buffer
        self.turn = 0

    def next(self) -> int:
        """The staging buffer the next `copy` reads (its copy of two copies ago long done: a step's collect waited)."""
        if self._copied[self.turn] is not None:
            self._copied[self.turn].synchronize()
        return self.turn

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst (device) <- src (bytes of host[turn]), then the other staging buffer's turn."""
        dst.copy_(src, non_blocking=True)
        if self._on_cuda:
            event = self._copied[self.turn] = self._copied[self.turn] or torch.cuda.Event()
            event.record()
        self.turn = 1 - self.turn


class GraphInputs:
    """The persistent device buffer, sized for the largest bucket (rows, seqs) at table width `width`, with
    up to `seqs` sampling rows and 2 * seqs extra entries, and its two host staging buffers."""

    MAX_VIEWS = 1024  # numpy views kept per staging buffer (one per layout seen): a bound, rarely reached

    def __init__(self, rows: int, seqs: int, width: int, device: torch.device,
                 max_sample: Optional[int] = None) -> None:
        """max_sample: the most sampling rows of a step (default: one per sequence; speculative decoding's verify
        steps sample at several rows of a sequence)."""
        self.width = width
        self.max_sample, self.max_extra = max_sample or seqs, 2 * seqs
        nbytes = layout(rows, seqs, width, self.max_sample, self.max_extra).nbytes
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._staging = PinnedStaging(self.buffer)
        # per staging buffer, by Layout.key: (numpy views of the segments, the copy's source and destination bytes,
        # the device views of the sample rows and extra entries)
        self._staged: List[Dict[Tuple[int, ...], tuple]] = [{}, {}]

    def layout(self, rows: int, seqs: int, sample_rows: int = 0, extra: int = 0) -> Layout:
        if sample_rows > self.max_sample or extra > self.max_extra:
            raise ValueError(f"a step with {sample_rows} sampling rows and {extra} extra entries does not fit the "
                             f"graph input buffer (at most {self.max_sample} and {self.max_extra})")
        return layout(rows, seqs, self.width, sample_rows, extra)

    def views(self, lay: Layout) -> Dict[str, torch.Tensor]:
        return lay.device_views(self.buffer)

    def stage(self, lay: Layout) -> Dict[str, np.ndarray]:
        """numpy views, laid out as lay, of the staging buffer the next `load` copies. Its bytes are those of an
        earlier step: the caller writes every element the graph reads."""
        return self._layout_of(self._staging.next(), lay)[0]

    def load(self, lay: Layout) -> Tuple[torch.Tensor, torch.Tensor]:
        """One copy of the staged step (`stage(lay)`, then written) into the device buffer (stream-ordered) ->
        the device views of its sample rows and extra entries."""
        _, src, dst, sample_rows, extra = self._layout_of(self._staging.turn, lay)
        self._staging.copy(src, dst)
        return sample_rows, extra

    def _layout_of(self, turn: int, lay: Layout) -> tuple:
        """A staging buffer's numpy views of lay's segments, the copy's source and destination, and the device
        views of the sample rows and extra entries (made once per layout)."""
        cache, key = self._staged[turn], lay.key
        entry = cache.get(key)
        if entry is None:
            if len(cache) >= self.MAX_VIEWS:
                cache.clear()
            host, buf = self._staging.host[turn], self.buffer
            entry = cache[key] = (lay.host_views(host.numpy()), host[:lay.nbytes], buf[:lay.nbytes],
                                  lay.device_view(buf, "sample_rows"), lay.device_view(buf, "extra"))
        return entry
