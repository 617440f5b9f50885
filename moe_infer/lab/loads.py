"""Expert load arrays: from a routing trace or from the engine's load statistics, and imbalance.

The load of an expert is the number of routed rows (token, k) it receives. Imbalance follows the
EPLB/TensorRT-LLM convention: (max - mean) / mean over the experts or GPUs of a layer (0 = even).

Legend: L MoE layers, E experts, S steps, T tokens, K top-k.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import numpy as np

from moe_infer.routing.trace import RoutingTrace


def expert_load(trace: RoutingTrace, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
    """float64 [L, E]: rows routed to each expert over the token rows [start, stop)."""
    ids_LN = trace.topk_ids_LTK[:, start:stop].reshape(trace.num_layers, -1)
    return np.stack([np.bincount(ids_N, minlength=trace.num_experts) for ids_N in ids_LN]).astype(np.float64)


def step_loads(trace: RoutingTrace) -> np.ndarray:
    """float64 [S, L, E]: the load of every engine step (rows grouped by `step_T`)."""
    bounds = trace.step_bounds()
    return np.stack([expert_load(trace, a, b) for a, b in zip(bounds[:-1], bounds[1:])])


def load_from_stats(rows: Iterable[Mapping]) -> np.ndarray:
    """float64 [L, E] from `LLM.get_expert_load()` (or its JSON): each row's `routed` list."""
    rows = list(rows)
    if not rows:
        raise ValueError("no expert load rows (were the statistics off? routing.collect_stats=true)")
    try:
        load_LE = np.array([list(r["routed"]) for r in rows], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"expert load rows need equal-length 'routed' lists ({err})") from err
    if load_LE.ndim != 2 or (load_LE < 0).any():
        raise ValueError(f"expert load must be a non-negative [layers, experts] table, got shape {load_LE.shape}")
    return load_LE


def imbalance(load_XN: np.ndarray, axis: int = -1) -> np.ndarray:
    """(max - mean) / mean over `axis` (0 where the mean is 0)."""
    load = np.asarray(load_XN, dtype=np.float64)
    mean = load.mean(axis=axis)
    return np.where(mean > 0, (load.max(axis=axis) - mean) / np.where(mean > 0, mean, 1.0), 0.0)
