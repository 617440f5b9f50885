"""Where a step's inputs lie on the device, on the rank that lays them out and on the ranks that receive them.

A step runs on one of three paths, chosen from its sizes (`StepPaths.choose`):

    PATH_DECODE_GRAPH   a pure decode that fits the decode graphs: DecodeGraphs' static buffer, one graph
                        (moe_infer/engine/cuda_graph.py)
    PATH_EXTEND_GRAPH   a prefill / mixed step that fits the prefill graphs: ExtendGraphs' buffer laid out for its
                        bucket, its graphs (moe_infer/engine/extend_graph.py)
    PATH_EAGER          anything else: `flat_inputs`' buffer on the device, an eager forward

On one rank `load` writes the step there (one host-to-device copy) and the forward reads it. Under a mesh the
driver loads, and the bytes it loaded (`payload`: one contiguous uint8 range of the path's device buffer, padding
included) travel over the device group; every other rank `receive`s them into the same range of its own buffer
(the buffers have the same layout on every rank: same sizes, same configuration), so every rank replays the same
graphs on the same inputs, and no rank's host waits on the device for them. A pipeline stage after the first also
receives the previous stage's hidden states (`hidden_input`: into its graphs' static buffer on a graph path).

Legend: T tokens of the step, B sequences, D hidden, X extra entries (the caller's own, after the step's).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import numpy as np
import torch

from moe_infer.engine.step_inputs import Sizes, StepInputs, decode_inputs
from moe_infer.parallel.step_message import PATH_DECODE_GRAPH, PATH_EAGER, PATH_EXTEND_GRAPH

Fill = Callable[[torch.Tensor], None]  # writes the sender's payload into the given uint8 device range


class StepPaths:
    """The paths of a runner: `owner.graphs` (DecodeGraphs) and `owner.extend_graphs` (ExtendGraphs), each possibly
    None, read at every call (a test or benchmark may swap them)."""

    def __init__(self, owner, device: torch.device, block_size: int) -> None:
        self.owner, self.device, self.block_size = owner, device, block_size

    @property
    def graphs(self):
        return self.owner.graphs

    @property
    def extend_graphs(self):
        return self.owner.extend_graphs

    def choose(self, sizes: Sizes) -> int:
        """The path of a step of these sizes: the decode graphs take what they can, the prefill graphs the rest that
        fits them."""
        if self.graphs is not None and self.graphs.can_run(sizes):
            return PATH_DECODE_GRAPH
        if self.extend_graphs is not None and self.extend_graphs.can_run(sizes):
            return PATH_EXTEND_GRAPH
        return PATH_EAGER

    def load(self, path: int, flat: np.ndarray, sizes: Sizes, num_extra: int
             ) -> Tuple[StepInputs, torch.Tensor, torch.Tensor]:
        """The step of `flat_inputs`' buffer (its last num_extra entries: the caller's own) on `path` ->
        (its inputs, the extra entries on the device, the payload: the device bytes that hold both)."""
        if path == PATH_DECODE_GRAPH:
            inputs, extra_X = self.graphs.load(flat, sizes, num_extra)
            return inputs, extra_X, self.graphs.payload(inputs)
        if path == PATH_EXTEND_GRAPH:
            inputs, extra_X = self.extend_graphs.load(flat, sizes, num_extra)
            return inputs, extra_X, self.extend_graphs.payload(inputs, num_extra)
        flat_dev = torch.from_numpy(flat).to(self.device, non_blocking=True)
        inputs, extra_X = self._eager(flat_dev, sizes, num_extra)
        return inputs, extra_X, flat_dev.view(torch.uint8)

    def broadcasts_inside(self, path: int) -> bool:
        """Whether the path's graphs receive the step's inputs themselves (their prologue: the first stage's
        broadcast), so that neither the driver nor the receiving ranks move them apart."""
        owner = self.graphs if path == PATH_DECODE_GRAPH else self.extend_graphs if path == PATH_EXTEND_GRAPH else None
        return owner is not None and owner.prologue is not None

    def receive(self, path: int, sizes: Sizes, num_extra: int, num_bytes: int, fill: Optional[Fill]
                ) -> Tuple[StepInputs, torch.Tensor, torch.Tensor]:
        """Another rank's `load` of the same step: fill (the transfer) writes its payload of num_bytes bytes into
        this rank's buffer of the path (fill None: the path's graphs do, `broadcasts_inside`) -> (inputs, extra
        entries, the payload's bytes here), as `load` gave there."""
        got = []

        def checked(buf_U: torch.Tensor) -> None:
            if buf_U.numel() != num_bytes:
                raise RuntimeError(f"the step's inputs take {num_bytes} bytes on the driver and {buf_U.numel()} here "
                                   f"(path {path}, sizes {sizes}): the ranks' buffers differ (same configuration?)")
            got.append(buf_U)
            if fill is not None:
                fill(buf_U)

        if path == PATH_DECODE_GRAPH:
            return (*self.graphs.receive(sizes, num_extra, checked), got[0])
        if path == PATH_EXTEND_GRAPH:
            return (*self.extend_graphs.receive(sizes, num_extra, checked), got[0])
        if path != PATH_EAGER:
            raise RuntimeError(f"unknown step path {path} in a step message")
        if num_bytes % 8:
            raise RuntimeError(f"an eager step's inputs are int64, got {num_bytes} bytes")
        if fill is None:
            raise RuntimeError("an eager step's inputs must be received before its forward")
        buf_U = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        checked(buf_U)
        return (*self._eager(buf_U.view(torch.int64), sizes, num_extra), buf_U)

    def _eager(self, flat_dev: torch.Tensor, sizes: Sizes, num_extra: int) -> Tuple[StepInputs, torch.Tensor]:
        n = flat_dev.numel() - num_extra
        return decode_inputs(flat_dev[:n], sizes, self.block_size), flat_dev[n:]

    def hidden_input(self, path: int, inputs: StepInputs, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Where a stage after the first receives the step's hidden states [T, D]: its graphs' static buffer on a
        graph path, a new tensor otherwise."""
        if path == PATH_DECODE_GRAPH:
            return self.graphs.hidden_input(inputs)
        if path == PATH_EXTEND_GRAPH:
            return self.extend_graphs.hidden_input(inputs)
        return torch.empty(inputs.sizes[0], hidden_size, dtype=dtype, device=self.device)


def fill_placeholders(inputs: StepInputs, extra_X: torch.Tensor, token_ids_B: torch.Tensor) -> None:
    """Rows of the step whose input is a token the step before sampled (async scheduling): extra_X holds their rows
    and that token's index among the earlier step's sampled ids token_ids_B, which stay on the device."""
    if extra_X.numel() == 0:
        return
    rows_R, src_R = extra_X.split(extra_X.numel() // 2)
    inputs.input_ids_T.index_copy_(0, rows_R, token_ids_B.index_select(0, src_R))
