"""Which speculative verify steps the decode graphs replay (moe_infer/engine/cuda_graph.py).

A verify step where every sequence runs q = k + 1 query tokens (its last token and k proposals) has the shape of a
decode step times q: it replays a captured graph per (padded batch, context bucket, q), the paged attention over the
q queries of each sequence inside it, and the LM head over every row. That takes an attention backend whose
launches are sized from the bucket, not from the data (`static_launch`: the paged Triton kernel, MLA's kernels), and
sequences up to the batch where speculation stops (`disable_by_batch_size`). The speculator makes the steps
uniform where it can (speculator.py: `pad_to_k`).
"""
from __future__ import annotations

from typing import Tuple

from moe_infer.config import EngineConfig
from moe_infer.engine.cuda_graph import static_attention


def verify_graph_shape(cfg: EngineConfig, model, max_batch: int) -> Tuple[int, int]:
    """(most query tokens a sequence, most sequences) of the verify steps the decode graphs take; (1, 0): none."""
    spec = cfg.speculative
    if not spec.enabled or not static_attention(model)[0]:
        return 1, 0
    limit = spec.disable_by_batch_size
    return spec.num_speculative_tokens + 1, min(max_batch, limit if limit is not None else max_batch)
