"""Per-forward context: the batch's attention metadata, set by the runner around one forward.

A context manager instead of a bare global: layers read `get_forward_context()` inside a forward
and nowhere else. Built once per step by the ModelRunner from the scheduler's plan.

Legend: T flattened tokens of the step, B sequences, M max blocks per sequence.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    positions_T: torch.Tensor  # int64: position of each token in its sequence
    slot_mapping_T: torch.Tensor  # int64: KV slot (block_id * block_size + offset) each token writes
    block_tables_BM: torch.Tensor  # int32: physical block ids of each sequence, padded with -1
    query_start_loc_B1: torch.Tensor  # int32 [B+1]: tokens of sequence b are [q[b], q[b+1])
    seq_lens_B: torch.Tensor  # int32: context length of each sequence after this step's tokens
    max_query_len: int
    max_seq_len: int
    block_size: int


@dataclass
class ForwardContext:
    attn: Optional[AttentionMetadata]
    valid_T: Optional[torch.Tensor] = None  # bool: False for padding rows of a CUDA-graph batch (None: all valid)


_CONTEXT: Optional[ForwardContext] = None


@contextmanager
def forward_context(attn: Optional[AttentionMetadata],
                    valid_T: Optional[torch.Tensor] = None) -> Iterator[ForwardContext]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ForwardContext(attn=attn, valid_T=valid_T)
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = prev


def valid_tokens() -> Optional[torch.Tensor]:
    """The padding mask of the running forward, None when every row is a real token (or no context)."""
    return _CONTEXT.valid_T if _CONTEXT is not None else None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: run the model inside `forward_context(...)`")
    return _CONTEXT
