"""CUDA graphs of an offloaded layer step's expert compute on device slots (`offload.expert_graphs`, on by default).

An offloaded decode step runs its MoE layers eagerly: the host decides per layer what to move
(engine/layer_graphs.py replays the attention parts around them). Within such a layer step, the experts
that run on the device run the same kernels every step over the same weight tensors, the layer's cache
slots or the two stream buffers that every layer shares; only the rows, slot ids and routing weights
change. Launched eagerly, one fused-experts call cost about 0.55 ms of host time under cProfile on an H100
(3-4 Triton launches through Triton's Python launcher; 16 Mixtral streams made 127 such calls a step),
and that host time runs before the host's own expert compute. Here each (weight tensors, padded rows,
top-k) gets one graph, captured the first time it is seen: a call copies its rows, ids and weights into
the graph's static buffers (pad rows get id -1, which adds nothing; only rows a larger earlier call left are
reset), replays, and returns a copy of its
rows of the output.

Rows are padded to a power of two up to `max_rows` (decode batches); larger calls (prefill chunks) and
calls once `max_graphs` graphs exist run eagerly. A failed capture switches the graphs off (logged once)
and the call runs eagerly. `capture=False` runs the same static-buffer path eagerly, so the padding and
the hand-over are testable without a GPU.

On by default since an A/B on an H200 (docs/offload.md, "The device experts as CUDA graphs"): decode was 1-13 %
faster at one and 16 Mixtral streams, in two processes with the order swapped. `model.enforce_eager` turns it off.

Legend: T rows of the call, Tp padded rows, D hidden, K top-k (ids per row).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Entry:
    x_TD: torch.Tensor  # static inputs [Tp, ...]
    ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    graph: Optional["torch.cuda.CUDAGraph"] = None
    out_TD: Optional[torch.Tensor] = None  # the graph's static output
    rows: int = 0  # rows the last call wrote; ids past them are -1 already


class ExpertGraphs:
    def __init__(self, device: torch.device, capture: bool = True, max_rows: int = 64, max_graphs: int = 512) -> None:
        self.device = torch.device(device)
        self.capture = capture and self.device.type == "cuda"
        self.max_rows, self.max_graphs = max_rows, max_graphs
        self.entries: Dict[Tuple, _Entry] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.disabled: Optional[str] = None
        self.replays = 0  # calls served by a graph (or, with capture=False, by the static-buffer path)
        self.eager = 0  # calls run as they are

    @staticmethod
    def padded(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()

    def __call__(self, compute: Compute, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """compute(x_TD, ids_TK, weights_TK, w13, w2), from a graph where one applies."""
        T, K = ids_TK.shape
        Tp = self.padded(T)
        key = (w13.data_ptr(), w2.data_ptr(), Tp, K, x_TD.dtype, ids_TK.dtype, weights_TK.dtype)
        entry = self.entries.get(key)
        if self.disabled is not None or T == 0 or Tp > self.max_rows or (
                entry is None and len(self.entries) >= self.max_graphs):
            self.eager += 1
            return compute(x_TD, ids_TK, weights_TK, w13, w2)
        if entry is None:
            entry = _Entry(x_TD.new_zeros(Tp, x_TD.shape[1]), ids_TK.new_full((Tp, K), -1), weights_TK.new_zeros(Tp, K))
            if not self.capture:
                self.entries[key] = entry
        entry.x_TD[:T].copy_(x_TD)
        entry.ids_TK[:T].copy_(ids_TK)
        if entry.rows > T:  # a larger call's rows are left there: they must run no expert
            entry.ids_TK[T:entry.rows].fill_(-1)
        entry.rows = T
        entry.weights_TK[:T].copy_(weights_TK)
        run = lambda: compute(entry.x_TD, entry.ids_TK, entry.weights_TK, w13, w2)  # noqa: E731
        if not self.capture:
            self.replays += 1
            return run()[:T].clone()
        if entry.graph is None:
            try:
                entry.graph, entry.out_TD = self._capture(run)
            except Exception as err:  # noqa: BLE001 - any capture failure means: run these calls eagerly
                self.disabled = f"{type(err).__name__}: {err}"
                logger.warning("offload expert graphs off (the calls run eagerly): capture failed: %s", self.disabled)
                self.eager += 1
                return compute(x_TD, ids_TK, weights_TK, w13, w2)
            self.entries[key] = entry
        entry.graph.replay()
        self.replays += 1
        return entry.out_TD[:T].clone()

    def _capture(self, run: Callable[[], torch.Tensor]):
        """(graph, static output) of run(): one eager warm-up on a side stream first (it compiles what is not
        compiled yet), after the work the current stream holds (the copies the slots wait for)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out_TD = run()
        return graph, out_TD
