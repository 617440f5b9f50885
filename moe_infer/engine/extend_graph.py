"""CUDA-graph replay of prefill, chunked-prefill and mixed steps: every step `DecodeGraphs` does not take.

Eagerly such a step is bound by host time, not by the GPU: on an H100 (8-layer Qwen3-30B-A3B shape,
`benchmarks/trials/step_breakdown.py`) the forward of one 1024-token prompt took 20.8 ms of host time
for 4.8 ms of kernels, one of 128 tokens 17.2 ms for 2.7 ms. Each layer's launches go through Python
(torch ops, Triton's launcher). Replayed, the step costs about its kernels.

What is captured: the whole model forward, attention included. The attention backend must declare
`static_launch` (the paged Triton kernel does): every launch parameter then comes from the bucket
(grid: padded sequences x query tiles of the longest query x KV heads, one key split) and the rest
(query starts, context lengths, block tables) is read on the device from the static buffers. The
gather backends ("torch", "sdpa") size their work from the data, so their steps run eagerly. The LM
head and the sampler run after the replay, on the step's real rows.

Buckets: one graph per (Tp, Bp, Qp), captured the first time it is seen (after one eager warm-up run
on the same buffers, `cuda_graph.capture_graph`), at most `max_graphs` of them; later new buckets run
eagerly.
- Tp tokens: 16, 32, ..., 512, then multiples of 512, up to `max_tokens` (model.cuda_graph_max_tokens);
- Bp sequences: the step's B plus one padding sequence, rounded up to a power of two;
- Qp, the longest query: the step's max_query_len and the padding sequence's length, rounded up to a
  power of two, at most Tp.
The context is not bucketed: the block-table buffer has the whole table's width and, with one key
split, each sequence's key range comes from its length on the device.

Padding: rows T..Tp-1 are the queries of a padding sequence B: no K/V slot written (slot -1), its
context is its own rows, read from block 0 (finite values: the cache is zero-initialised and only
ever holds written K/V), left out of the expert-load statistics (`valid_T`); sequences B+1..Bp-1 have
no query rows. None of their outputs is read.

Legend: T tokens of the step, Tp padded, B sequences, Bp padded, M blocks per sequence of the whole
table, D hidden.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from moe_infer.engine.cuda_graph import ForwardFn, replay_graph
from moe_infer.layers.forward_context import AttentionMetadata, forward_context

logger = logging.getLogger(__name__)

MAX_GRAPHS = 64  # a graph keeps its output [Tp, D] and the pool its intermediates: bounded


def token_buckets(max_tokens: int) -> List[int]:
    """Padded token counts: 16, 32, ..., 512, then multiples of 512, the last one max_tokens itself."""
    if max_tokens <= 0:
        raise ValueError(f"cuda graph max tokens must be positive, got {max_tokens}")
    small = [t for t in (16, 32, 64, 128, 256, 512) if t < max_tokens]
    return small + list(range(1024, max_tokens, 512)) + [max_tokens]


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class ExtendGraphs:
    """Static buffers + one captured graph per (Tp, Bp, Qp) bucket.

    capture=False runs the same padded, static-buffer forward eagerly (testable without a GPU: the
    result must equal the unpadded eager forward row for row).
    """

    def __init__(self, forward: ForwardFn, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int,
                 device: torch.device, capture: bool = True, pool=None, max_graphs: int = MAX_GRAPHS) -> None:
        self.forward, self.block_size, self.max_blocks = forward, block_size, max_blocks
        self.sizes = token_buckets(max_tokens)
        self.max_tokens, self.max_seqs = self.sizes[-1], next_pow2(max_seqs + 1)
        self.capture, self.max_graphs = capture, max_graphs
        Tmax, Bmax, dev = self.max_tokens, self.max_seqs, device
        self.input_ids_T = torch.zeros(Tmax, dtype=torch.int64, device=dev)
        self.positions_T = torch.zeros(Tmax, dtype=torch.int64, device=dev)
        self.slot_mapping_T = torch.full((Tmax,), -1, dtype=torch.int64, device=dev)
        self.valid_T = torch.zeros(Tmax, dtype=torch.bool, device=dev)
        self.block_tables_BM = torch.zeros(Bmax, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens_B = torch.ones(Bmax, dtype=torch.int32, device=dev)
        self.query_start_loc_B1 = torch.zeros(Bmax + 1, dtype=torch.int32, device=dev)
        self.graphs: Dict[Tuple[int, int, int], Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = (pool if pool is not None else torch.cuda.graph_pool_handle()) if capture else None
        self.disabled: Optional[str] = None  # why graphs were switched off after a failed capture
        self.full_logged = False
        self.runs = 0  # steps that went through the static buffers (replayed, or eager with capture=False)

    def can_run(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """A step that fits the buffers and whose padding sequence fits one row of the block table."""
        if self.disabled is not None or num_tokens == 0 or num_tokens > self.max_tokens:
            return False
        B = meta.seq_lens_B.shape[0]
        Tp = self._tokens(num_tokens)
        return (B + 1 <= self.max_seqs and meta.block_tables_BM.shape[1] <= self.max_blocks
                and Tp - num_tokens <= self.max_blocks * self.block_size)

    def _tokens(self, T: int) -> int:
        return next(t for t in self.sizes if t >= T)

    def bucket(self, T: int, meta: AttentionMetadata) -> Tuple[int, int, int]:
        Tp = self._tokens(T)
        Bp = next_pow2(meta.seq_lens_B.shape[0] + 1)
        Qp = min(next_pow2(max(meta.max_query_len, Tp - T, 1)), Tp)
        return Tp, Bp, Qp

    def _fill(self, input_ids_T: torch.Tensor, meta: AttentionMetadata, Tp: int, Bp: int) -> None:
        """Copies the step into the static buffers; rows T..Tp-1 and sequences B..Bp-1 become padding."""
        T, (B, m) = input_ids_T.shape[0], meta.block_tables_BM.shape
        pad = Tp - T
        self.input_ids_T[:T].copy_(input_ids_T)
        self.positions_T[:T].copy_(meta.positions_T)
        self.slot_mapping_T[:T].copy_(meta.slot_mapping_T)
        self.valid_T[:T].fill_(True)
        self.block_tables_BM[:B, :m].copy_(meta.block_tables_BM)
        self.seq_lens_B[:B].copy_(meta.seq_lens_B)
        self.query_start_loc_B1[:B + 1].copy_(meta.query_start_loc_B1)
        if pad:  # the padding sequence B: rows T..Tp-1 at positions 0..pad-1 over keys of block 0
            torch.arange(pad, out=self.positions_T[T:Tp])
            self.input_ids_T[T:Tp].zero_()
            self.slot_mapping_T[T:Tp].fill_(-1)
            self.valid_T[T:Tp].fill_(False)
        self.block_tables_BM[B].zero_()
        self.seq_lens_B[B:Bp].fill_(max(pad, 1))
        self.query_start_loc_B1[B + 1:Bp + 1].fill_(Tp)

    def _meta(self, Tp: int, Bp: int, Qp: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions_T=self.positions_T[:Tp], slot_mapping_T=self.slot_mapping_T[:Tp],
            block_tables_BM=self.block_tables_BM[:Bp], query_start_loc_B1=self.query_start_loc_B1[:Bp + 1],
            seq_lens_B=self.seq_lens_B[:Bp], max_query_len=Qp, max_seq_len=self.max_blocks * self.block_size,
            block_size=self.block_size,
        )

    def _run_static(self, Tp: int, Bp: int, Qp: int) -> torch.Tensor:
        with forward_context(self._meta(Tp, Bp, Qp), valid_T=self.valid_T[:Tp]):
            return self.forward(self.input_ids_T[:Tp], self.positions_T[:Tp])

    def run(self, input_ids_T: torch.Tensor, meta: AttentionMetadata) -> Optional[torch.Tensor]:
        """hidden [T, D] of the step, or None: run it eagerly (a capture failed, or the graph budget is spent)."""
        T = input_ids_T.shape[0]
        key = self.bucket(T, meta)
        if self.capture and key not in self.graphs and len(self.graphs) >= self.max_graphs:
            if not self.full_logged:
                self.full_logged = True
                logger.info("%d prefill/mixed-step CUDA graphs captured (the limit): steps of new shapes run "
                            "eagerly", self.max_graphs)
            return None
        self._fill(input_ids_T, meta, key[0], key[1])
        if not self.capture:
            self.runs += 1
            return self._run_static(*key)[:T]
        out_TpD = replay_graph(self, key, lambda: self._run_static(*key), self.valid_T,
                               f"a step of {T} tokens (bucket {key})")
        return None if out_TpD is None else out_TpD[:T]
