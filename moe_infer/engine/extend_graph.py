"""CUDA-graph replay of prefill, chunked-prefill and mixed steps: every step `DecodeGraphs` does not take.

Eagerly such a step is bound by host time, not by the GPU: on an H100 (8-layer Qwen3-30B-A3B shape,
`benchmarks/trials/step_breakdown.py`) the forward of one 1024-token prompt took 20.8 ms of host time
for 4.8 ms of kernels, one of 128 tokens 17.2 ms for 2.7 ms. Each layer's launches go through Python
(torch ops, Triton's launcher). Replayed, the step costs about its kernels.

What is captured: the whole model forward, attention included, as two graphs replayed one after the other
where the model can be split (`MoEModel.forward_head` / `forward_tail`): its first layer, then the rest. A
graph's launch costs host time in proportion to its kernels, and the GPU runs none of them before the launch
ends; with the first layer apart, the GPU starts after a short launch and the long one overlaps it. The attention backend must declare
`static_launch` (the paged Triton kernel does): every launch parameter then comes from the bucket
(grid: padded sequences x query tiles of the longest query x KV heads, one key split) and the rest
(query starts, context lengths, block tables) is read on the device from the static buffers. The
gather backends ("torch", "sdpa") size their work from the data, so their steps run eagerly. The LM
head and the sampler run after the replay, on the step's real rows.

Buckets: one graph (or pair) per (Tp, Bp, Qp), captured the first time it is seen (after one eager warm-up
run on the same buffers, `cuda_graph.capture_graph`), at most `max_graphs` buckets; later new buckets run
eagerly.
- Tp tokens: 16, 32, ..., 512, then multiples of 512, up to `max_tokens` (model.cuda_graph_max_tokens);
- Bp sequences: the step's B plus one padding sequence, rounded up to a power of two;
- Qp, the longest query: the step's max_query_len and the padding sequence's length, rounded up to a
  power of two, at most Tp.
The context is not bucketed: the block-table buffer has the whole table's width and, with one key
split, each sequence's key range comes from its length on the device.

Inputs: the host lays the step out, padding included, as the bucket's graph reads it, and one copy moves it
into a persistent device buffer (`graph_inputs.py`); `load` does that, `replay` runs the bucket's graph.

Padding: rows T..Tp-1 are the queries of a padding sequence B: no K/V slot written (slot -1), its
context is its own rows, read from block 0 (finite values: the cache is zero-initialised and only
ever holds written K/V), left out of the expert-load statistics (`valid_T`); sequences B+1..Bp-1 have
no query rows. None of their outputs is read.

Legend: T tokens of the step, Tp padded, B sequences, Bp padded, M blocks per sequence of the whole
table, D hidden.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from moe_infer.engine.cuda_graph import ForwardFn, capture_graph, replay_graph
from moe_infer.engine.graph_inputs import GraphInputs
from moe_infer.engine.step_inputs import Sizes, StepInputs, host_segments
from moe_infer.layers.forward_context import AttentionMetadata, forward_context

logger = logging.getLogger(__name__)

MAX_GRAPHS = 64  # a bucket's graphs keep their output [Tp, D] and the pool their intermediates: bounded
# A bucket's first layer(s) are a graph of their own: its launch is short, and the GPU runs it while the host
# launches the rest (on an H100 one graph of the 8-layer Qwen3-30B-A3B shape took 150-220 us to launch, every
# one of them before the first kernel ran: on the critical path of a prompt's first token).
HEAD_LAYERS = 1


def token_buckets(max_tokens: int, smallest: int = 16) -> List[int]:
    """Padded token counts: 16, 32, ..., 512, then multiples of 512, the last one max_tokens itself (smallest=4: 4
    and 8 first; speculative decoding's verify steps of a few sequences, whose padding rows would read experts)."""
    if max_tokens <= 0:
        raise ValueError(f"cuda graph max tokens must be positive, got {max_tokens}")
    small = [t for t in (4, 8, 16, 32, 64, 128, 256, 512) if smallest <= t < max_tokens]
    return small + list(range(1024, max_tokens, 512)) + [max_tokens]


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class ExtendGraphs:
    """The inputs buffer + one captured graph per (Tp, Bp, Qp) bucket.

    capture=False runs the same padded, static-buffer forward eagerly (testable without a GPU: the
    result must equal the unpadded eager forward row for row).
    """

    def __init__(self, forward: ForwardFn, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int,
                 device: torch.device, capture: bool = True, pool=None, max_graphs: int = MAX_GRAPHS,
                 last_rows: bool = False, hidden_in: Optional[Tuple[int, torch.dtype]] = None,
                 mesh: bool = False, prologue: Optional[Callable[[torch.Tensor], None]] = None,
                 max_sample_rows: Optional[int] = None, min_bucket: int = 16) -> None:
        """hidden_in (hidden size, dtype): a pipeline stage after the first (`hidden_input`); mesh, prologue: as
        DecodeGraphs' (the prologue gets the bytes any step of the bucket may read, `payload_region`);
        max_sample_rows: the most sampling rows of a step (default one per sequence; speculative verify steps);
        min_bucket: the smallest padded token count (`token_buckets`)."""
        self.forward, self.block_size, self.max_blocks, self.mesh = forward, block_size, max_blocks, mesh
        self.prologue = prologue
        self.last_rows = last_rows  # the last layer runs each sequence's last row only (layers/last_rows.py)
        self.sizes = token_buckets(max_tokens, min_bucket)
        self.max_tokens, self.max_seqs = self.sizes[-1], next_pow2(max_seqs + 1)
        self.capture, self.max_graphs = capture, max_graphs
        self.inputs = GraphInputs(self.max_tokens, self.max_seqs, max_blocks, device,
                                  max_sample=None if max_sample_rows is None else max(max_sample_rows, self.max_seqs))
        self.hidden_in_TD = (None if hidden_in is None else
                             torch.zeros(self.max_tokens, hidden_in[0], dtype=hidden_in[1], device=device))
        self.views: Dict[Tuple[int, int], Dict[str, torch.Tensor]] = {}  # (Tp, Bp) -> the graph's input views
        self._arange = np.arange(self.max_tokens, dtype=np.int64)  # the padding sequence's positions
        self.graphs: Dict[Tuple[int, int, int], Tuple[List[torch.cuda.CUDAGraph], torch.Tensor]] = {}
        self.pool = (pool if pool is not None else torch.cuda.graph_pool_handle()) if capture else None
        self.disabled: Optional[str] = None  # why graphs were switched off after a failed capture
        self.full_logged = False
        self.runs = 0  # steps that went through the static buffers (replayed, or eager with capture=False)

    def can_run(self, sizes: Sizes) -> bool:
        """A step that fits the buffers and whose padding sequence fits one row of the block table."""
        T, B, S, m = sizes[:4]
        if self.disabled is not None or T == 0 or T > self.max_tokens or S > self.inputs.max_sample:
            return False
        return B + 1 <= self.max_seqs and m <= self.max_blocks and self._tokens(T) - T <= self.max_blocks * self.block_size

    def _tokens(self, T: int) -> int:
        return next(t for t in self.sizes if t >= T)

    def bucket(self, sizes: Sizes) -> Tuple[int, int, int]:
        T, B, max_query_len = sizes[0], sizes[1], sizes[4]
        Tp = self._tokens(T)
        Bp = next_pow2(B + 1)
        Qp = min(next_pow2(max(max_query_len, Tp - T, 1)), Tp)
        return Tp, Bp, Qp

    def _views(self, Tp: int, Bp: int) -> Dict[str, torch.Tensor]:
        if (Tp, Bp) not in self.views:
            self.views[(Tp, Bp)] = self.inputs.views(self.inputs.layout(Tp, Bp))
        return self.views[(Tp, Bp)]

    def load(self, flat: np.ndarray, sizes: Sizes, num_extra: int) -> Tuple[StepInputs, torch.Tensor]:
        """The step of `flat_inputs`' buffer (its last num_extra entries: the caller's own) in the bucket's
        layout, padding included, copied to the device in one copy -> (its inputs, the extra entries).
        Rows T..Tp-1 become the padding sequence B, sequences B+1..Bp-1 have no rows. Every element is written
        (the staging buffer holds an earlier step)."""
        T, S = sizes[0], sizes[2]
        key = Tp, Bp, _ = self.bucket(sizes)
        lay = self.inputs.layout(Tp, Bp, S, num_extra)
        self.stage_step(self.inputs.stage(lay), flat, sizes)
        sample_rows_S, extra_X = self.inputs.load(lay)
        d = self._views(Tp, Bp)
        return (StepInputs(d["ids"][:T], functools.partial(self._step_meta, d, sizes), sample_rows_S, sizes, key),
                extra_X)

    def stage_step(self, v, flat: np.ndarray, sizes: Sizes) -> None:
        """Writes the step, padding included, into host views `v` laid out as its bucket's (`load`'s staging, or a
        replica's segment under attention data parallelism: moe_infer/engine/dp_inputs.py)."""
        T, B, m = sizes[0], sizes[1], sizes[3]
        Tp, _, _ = self.bucket(sizes)
        src, pad = host_segments(flat, sizes), Tp - T
        v["ids"][:T], v["ids"][T:] = src.ids_T, 0
        v["positions"][:T], v["positions"][T:] = src.positions_T, self._arange[:pad]  # the padding sequence B:
        v["slots"][:T], v["slots"][T:] = src.slots_T, -1  # positions 0..pad-1 over keys of block 0, no K/V written
        v["valid"][:T], v["valid"][T:] = True, False
        v["query_starts"][:B + 1], v["query_starts"][B + 1:] = src.query_start_B1, Tp
        v["seq_lens"][:B], v["seq_lens"][B:] = src.seq_lens_B, max(pad, 1)
        tables = v["block_tables"]
        tables[:B, :m], tables[:B, m:], tables[B:] = src.block_tables_BM, -1, 0  # row B: block 0 (zero-filled)
        v["sample_rows"][:], v["extra"][:len(src.extra)] = src.sample_rows_S, src.extra

    def receive(self, sizes: Sizes, num_extra: int, fill: Callable[[torch.Tensor], None]) -> Tuple[StepInputs, torch.Tensor]:
        """Another rank's `load` of the same step: fill(bytes) writes the bytes it loaded into this rank's buffer."""
        T, S = sizes[0], sizes[2]
        key = Tp, Bp, _ = self.bucket(sizes)
        lay = self.inputs.layout(Tp, Bp, S, num_extra)
        fill(self.inputs.buffer[:lay.nbytes])
        d = self._views(Tp, Bp)
        return (StepInputs(d["ids"][:T], functools.partial(self._step_meta, d, sizes),
                           lay.device_view(self.inputs.buffer, "sample_rows"), sizes, key),
                lay.device_view(self.inputs.buffer, "extra"))

    def payload_region(self, Tp: int, Bp: int) -> torch.Tensor:
        """The bytes any step of a bucket of Tp rows and Bp sequences may read (its most sampling rows and extra
        entries): what the prologue broadcasts."""
        return self.inputs.buffer[:self.inputs.layout(Tp, Bp, self.inputs.max_sample, self.inputs.max_extra).nbytes]

    def _prologue(self, Tp: int, Bp: int) -> None:
        if self.prologue is not None:
            self.prologue(self.payload_region(Tp, Bp))

    def payload(self, inputs: StepInputs, num_extra: int) -> torch.Tensor:
        """The bytes of the buffer a `load`ed step reads (uint8, on the device): what the other ranks receive."""
        Tp, Bp, _ = inputs.bucket
        return self.inputs.buffer[:self.inputs.layout(Tp, Bp, inputs.sizes[2], num_extra).nbytes]

    def hidden_input(self, inputs: StepInputs) -> torch.Tensor:
        """Where a pipeline stage after the first receives the step's hidden states [T, D] (its graphs read them)."""
        return self.hidden_in_TD[:inputs.sizes[0]]

    def _hidden(self, Tp: int) -> Optional[torch.Tensor]:
        return None if self.hidden_in_TD is None else self.hidden_in_TD[:Tp]

    def _step_meta(self, d: Dict[str, torch.Tensor], sizes: Sizes) -> AttentionMetadata:
        """The step's own (unpadded) attention metadata over the bucket's views: for an eager run."""
        T, B, _, m, max_query_len, max_seq_len = sizes
        return AttentionMetadata(
            positions_T=d["positions"][:T], slot_mapping_T=d["slots"][:T], block_tables_BM=d["block_tables"][:B, :m],
            query_start_loc_B1=d["query_starts"][:B + 1], seq_lens_B=d["seq_lens"][:B], max_query_len=max_query_len,
            max_seq_len=max_seq_len, block_size=self.block_size)

    def _meta(self, Tp: int, Bp: int, Qp: int) -> AttentionMetadata:
        v = self._views(Tp, Bp)
        return AttentionMetadata(
            positions_T=v["positions"], slot_mapping_T=v["slots"], block_tables_BM=v["block_tables"],
            query_start_loc_B1=v["query_starts"], seq_lens_B=v["seq_lens"], max_query_len=Qp,
            max_seq_len=self.max_blocks * self.block_size, block_size=self.block_size,
        )

    def _run_static(self, Tp: int, Bp: int, Qp: int) -> torch.Tensor:
        self._prologue(Tp, Bp)
        v = self._views(Tp, Bp)
        with forward_context(self._meta(Tp, Bp, Qp), valid_T=v["valid"], last_rows=self.last_rows):
            if self.hidden_in_TD is None:
                return self.forward(v["ids"], v["positions"])
            return self.forward(v["ids"], v["positions"], self._hidden(Tp))

    def _out_rows(self, key: Tuple[int, int, int], T: int, B: int) -> int:
        """Rows of the step's output: one a sequence where the forward ran its last layer on those (a bucket whose
        longest query has more than one row, `MoEModel.forward_tail`), else one a token."""
        return B if self.last_rows and key[2] > 1 else T

    def _pieces(self) -> Optional[Tuple[Callable, Callable]]:
        """(forward_head, forward_tail) of a model that has them and more than HEAD_LAYERS layers, else None."""
        head, tail = getattr(self.forward, "forward_head", None), getattr(self.forward, "forward_tail", None)
        if head is None or tail is None or len(getattr(self.forward, "local_layers", ())) <= HEAD_LAYERS:
            return None
        return head, tail

    def _capture(self, key: Tuple[int, int, int]) -> Tuple[List[torch.cuda.CUDAGraph], torch.Tensor]:
        """The bucket's graphs, replayed in order, and their static output: the model's first HEAD_LAYERS layers
        and the rest as two graphs where the model can be split (`_pieces`), else one."""
        v, pieces = self._views(*key[:2]), self._pieces()
        if pieces is None:
            graph, out = capture_graph(lambda: self._run_static(*key), v["valid"], self.pool, mesh=self.mesh)
            return [graph], out
        head, tail = pieces
        meta, valid_copy = self._meta(*key), v["valid"].clone()
        v["valid"].fill_(False)  # nothing counted in the load statistics until the real replay

        def run_head():
            self._prologue(*key[:2])
            with forward_context(meta, valid_T=v["valid"], last_rows=self.last_rows):
                return head(v["ids"], v["positions"], self._hidden(key[0]), num_layers=HEAD_LAYERS)

        head_graph, (h_TD, delta_TD) = capture_graph(run_head, v["valid"], self.pool, mesh=self.mesh)
        head_graph.replay()  # the head's outputs now hold the step's values: the tail's warm-up run reads them

        def run_tail():
            with forward_context(meta, valid_T=v["valid"], last_rows=self.last_rows):
                return tail(h_TD, delta_TD, v["positions"], first_layer=HEAD_LAYERS)

        tail_graph, out = capture_graph(run_tail, v["valid"], self.pool, mesh=self.mesh)
        v["valid"].copy_(valid_copy)
        return [head_graph, tail_graph], out

    def replay(self, inputs: StepInputs) -> Optional[torch.Tensor]:
        """hidden [T, D] of a step `load`ed into the buffer ([B, D], each sequence's last row, where the last
        layer ran those only: `_out_rows`), or None: run it eagerly (a capture failed, or the graph budget is spent)."""
        key, T = inputs.bucket, inputs.input_ids_T.shape[0]
        rows = self._out_rows(key, T, inputs.sizes[1])
        if not self.capture:
            self.runs += 1
            return self._run_static(*key)[:rows]
        if key not in self.graphs and len(self.graphs) >= self.max_graphs:
            if not self.full_logged:
                self.full_logged = True
                logger.info("%d prefill/mixed-step CUDA graphs captured (the limit): steps of new shapes run "
                            "eagerly", self.max_graphs)
            self._prologue(*key[:2])  # the eager run reads the buffer too: the inputs must be there
            return None
        out_TpD = replay_graph(self, key, lambda: self._capture(key), f"a step of {T} tokens (bucket {key})")
        return None if out_TpD is None else out_TpD[:rows]
