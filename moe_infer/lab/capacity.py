"""Replay the engine's capacity policies (`moe_infer.routing.capacity`) on a routing trace.

Each engine step of the trace is one policy call, as in the engine (the capacity depends on the
step's token count). Layers are replayed independently on the router's recorded choice: for a
trace recorded under that same policy this reproduces the engine's own drop / reroute counts
exactly; for a dropless trace it is the first-order estimate (the model's later layers would see
hidden states changed by the drops). `reroute` and `drop_by=score` need the router logits
(`routing.trace_logits=true`, or a synthetic trace `with_logits`).

Legend: L MoE layers, E experts, T tokens of a step, K top-k.
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from moe_infer.routing.capacity import CAPACITY_POLICIES
from moe_infer.routing.spec import RoutingSpec
from moe_infer.routing.trace import RoutingTrace


def replay_policy(trace: RoutingTrace, policy: str, capacity_factor: float = 1.0, min_capacity: int = 4,
                  drop_by: str = "position", renormalize: bool = True) -> Dict[str, np.ndarray]:
    """int64 [L, E] counts: routed, dropped and rerouted rows per (layer, router-chosen expert), the
    layout of `ExpertLoadStats`."""
    fn = CAPACITY_POLICIES.get(policy)
    needs_logits = policy == "reroute" or drop_by == "score"
    if needs_logits and trace.router_logits_LTE is None:
        raise ValueError(f"policy={policy} with drop_by={drop_by} needs a trace with router logits "
                         "(record with routing.trace_logits=true)")
    spec = RoutingSpec(num_experts=trace.num_experts, top_k=trace.top_k, renormalize=renormalize)
    L, E = trace.num_layers, trace.num_experts
    out = {name: np.zeros((L, E), dtype=np.int64) for name in ("routed", "dropped", "rerouted")}
    bounds = trace.step_bounds()
    for layer in range(L):
        for a, b in zip(bounds[:-1], bounds[1:]):
            ids_TK = torch.from_numpy(trace.topk_ids_LTK[layer, a:b]).to(torch.int32)
            w_TK = torch.from_numpy(trace.topk_weights_LTK[layer, a:b])
            logits = None if trace.router_logits_LTE is None else torch.from_numpy(trace.router_logits_LTE[layer, a:b])
            kept_TK, _ = fn(ids_TK, w_TK, logits_TE=logits, spec=spec, capacity_factor=capacity_factor,
                            min_capacity=min_capacity, drop_by=drop_by, backend="torch")
            ids_N, kept_N = ids_TK.reshape(-1).long().numpy(), kept_TK.reshape(-1).long().numpy()
            out["routed"][layer] += np.bincount(ids_N, minlength=E)
            out["dropped"][layer] += np.bincount(ids_N[kept_N < 0], minlength=E)
            out["rerouted"][layer] += np.bincount(ids_N[(kept_N >= 0) & (kept_N != ids_N)], minlength=E)
    return out
