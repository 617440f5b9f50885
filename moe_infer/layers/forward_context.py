"""Per-forward context: the batch's attention metadata, set by the runner around one forward.

A context manager instead of a bare global: layers read `get_forward_context()` inside a forward
and nowhere else. Built once per step by the ModelRunner from the scheduler's plan. Work that nothing in
the forward reads (the expert-load counts) can wait for its end: `at_forward_end`.

Legend: T flattened tokens of the step, B sequences, M max blocks per sequence.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional

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
    last_rows: bool = False  # the last layer computes each sequence's last row only (moe_infer/layers/last_rows.py)
    at_end: Dict[int, Callable[[], None]] = field(default_factory=dict)  # `at_forward_end`, by owner id
    memo: Dict[Any, Any] = field(default_factory=dict)  # what the layers compute once per forward (the MoE layers'
    # gathered padding mask under attention data parallelism)


_CONTEXT: Optional[ForwardContext] = None


@contextmanager
def forward_context(attn: Optional[AttentionMetadata], valid_T: Optional[torch.Tensor] = None,
                    last_rows: bool = False) -> Iterator[ForwardContext]:
    global _CONTEXT
    ctx = ForwardContext(attn=attn, valid_T=valid_T, last_rows=last_rows)
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev
        for fn in ctx.at_end.values():  # inside the forward's stream order (and its graph capture, if any)
            fn()


def at_forward_end(owner: object, fn: Callable[[], None]) -> bool:
    """Run fn once when the running forward context closes (one registration per owner); False when no forward
    runs (the caller does the work now)."""
    if _CONTEXT is None:
        return False
    _CONTEXT.at_end.setdefault(id(owner), fn)
    return True


@contextmanager
def fewer_rows(attn: AttentionMetadata, valid: Optional[torch.Tensor]) -> Iterator[None]:
    """Inside a forward, for a part that runs fewer rows (the last layer's MLP, moe_infer/layers/last_rows.py):
    their metadata (what a row's sequence and position are) and padding mask in place of the step's."""
    ctx = get_forward_context()
    prev = ctx.attn, ctx.valid_T
    ctx.attn, ctx.valid_T = attn, valid
    try:
        yield
    finally:
        ctx.attn, ctx.valid_T = prev


def valid_tokens() -> Optional[torch.Tensor]:
    """The padding mask of the running forward, None when every row is a real token (or no context)."""
    return _CONTEXT.valid_T if _CONTEXT is not None else None


def current_forward_context() -> Optional[ForwardContext]:
    """The running forward's context, None outside a forward."""
    return _CONTEXT


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: run the model inside `forward_context(...)`")
    return _CONTEXT
