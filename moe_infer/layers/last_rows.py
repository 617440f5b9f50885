"""The last layer of a step with prompt tokens computes, past its K/V write, only each sequence's last row.

Of a prompt chunk's rows, the model's output is read at one: the sequence's last token, where it samples
(moe_infer/engine/model_runner.py). In every layer but the last the other rows still matter, as the keys and
values the next layer's attention reads; in the last layer nothing reads them after its K/V write. So the
last layer writes the K/V of every row, then runs attention, o_proj, its norm and its MoE (or MLP) on one row
a sequence, attended as a decode step attends (one query over the sequence's cached keys), and the model
returns [B, D]. The saving is one layer's work on T - B rows: about 1/L of a prefill's forward for L layers
(llama.cpp does the same with its output ids). Decode steps (one row a sequence) are left alone.

Turned on per forward by the caller (`forward_context(..., last_rows=True)`: the model runner, on one rank and on
every rank of a mesh's last pipeline stage alike; `model.prune_last_layer`). Off where rows are coupled or every row is recorded: capacity policies other than
dropless (whether a row is dropped depends on the other rows), the routing trace. The last layer's expert-load
statistics then count its computed rows only. A feature that reads the output at other rows (prompt logprobs, not
supported yet) would have to turn it off for its steps.

Legend: T tokens of the step, B sequences (one row each), H query heads, d head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_infer.layers.forward_context import AttentionMetadata


@dataclass(frozen=True)
class LastRows:
    """The rows the last layer computes past its K/V write, and their attention as decode queries."""

    keep_B: torch.Tensor  # int64: each sequence's last row in the step (one without rows: a row before it, unread)
    attn: AttentionMetadata  # one query a sequence over its cached keys (the step's K/V already written)
    valid_B: Optional[torch.Tensor]  # bool: rows that are real tokens (None: all are)


def last_rows(attn: AttentionMetadata, valid_T: Optional[torch.Tensor]) -> LastRows:
    """Each sequence's last row of a step (no host sync: CUDA-graph safe). A sequence without rows in the step
    (the padding sequences of a CUDA-graph bucket) gets the row before its start, and valid_B leaves it out."""
    qs_B1 = attn.query_start_loc_B1
    B = qs_B1.shape[0] - 1
    keep_B = (qs_B1[1:] - 1).clamp_min(0).long()
    valid_B = None
    if valid_T is not None:
        valid_B = (qs_B1[1:] > qs_B1[:-1]) & valid_T.index_select(0, keep_B)
    positions_B = attn.positions_T.index_select(0, keep_B)
    meta = AttentionMetadata(
        positions_T=positions_B, slot_mapping_T=attn.slot_mapping_T.index_select(0, keep_B),
        block_tables_BM=attn.block_tables_BM, seq_lens_B=attn.seq_lens_B,
        query_start_loc_B1=torch.arange(B + 1, dtype=qs_B1.dtype, device=qs_B1.device),
        max_query_len=1, max_seq_len=attn.max_seq_len, block_size=attn.block_size)
    return LastRows(keep_B, meta, valid_B)
