"""Replay a routing trace over N GPUs with the calibrated cost model: step time, stragglers, throughput.

The cluster runs data-parallel attention and expert-parallel MoE layers (DeepSeek's deployment
shape): each step every GPU brings `tokens_per_gpu` tokens, taken from the trace in order from
`start_token` (wrapping around to it), so GPU g owns rows [g B, (g+1) B) of the step. A routed row of a replicated
expert goes to replica (row + source GPU) mod replicas, as the EP dispatcher sends it. With a
capacity factor, each source GPU keeps at most C = max(ceil(cf B K / E), min_capacity) rows per
expert, first come first kept (the `drop` policy by position, applied per source GPU); the
`capacity` dispatcher then sends C rows per (source, destination slot) whatever the routing.

Per layer: route + max_g dispatch_g + max_g experts_g + max_g combine_g (every phase waits for
its slowest GPU; `CostModel`). The straggler share is the part of that time the GPUs above the
mean cause: 1 - (the same sum with each phase at its mean over GPUs) / (the time).

Legend: N GPUs, B tokens per GPU and step, K top-k, E experts, P physical slots, S slots per GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np

from moe_infer.lab.cost_model import CostModel
from moe_infer.lab.eplb import Plan, contiguous_plan
from moe_infer.lab.migration import align
from moe_infer.routing.trace import RoutingTrace


@dataclass
class SimConfig:
    num_gpus: int = 8
    tokens_per_gpu: int = 256
    num_steps: int = 8
    start_token: int = 0  # the first trace row of the first step
    capacity_factor: Optional[float] = None  # None: dropless
    min_capacity: int = 4
    dispatcher: str = "exact"  # exact: the rows routed travel | capacity: C rows per (source, slot)

    def __post_init__(self) -> None:
        for name in ("num_gpus", "tokens_per_gpu", "num_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"simulate.{name} must be positive, got {getattr(self, name)}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"simulate.capacity_factor must be positive, got {self.capacity_factor}")
        if self.dispatcher not in ("exact", "capacity"):
            raise ValueError(f"simulate.dispatcher must be exact or capacity, got {self.dispatcher!r}")
        if self.dispatcher == "capacity" and self.capacity_factor is None:
            raise ValueError("simulate.dispatcher=capacity needs a capacity_factor")


def step_rows(trace: RoutingTrace, step: int, cfg: SimConfig) -> np.ndarray:
    """int64 [N*B]: the trace rows of one simulated step: in order from start_token, wrapping around
    inside [start_token, end of trace)."""
    n = cfg.num_gpus * cfg.tokens_per_gpu
    span = trace.num_tokens - cfg.start_token
    if span <= 0:
        raise ValueError(f"simulate: start_token={cfg.start_token} leaves none of the trace's {trace.num_tokens} tokens")
    return cfg.start_token + (step * n + np.arange(n)) % span


def capacity_keep(ids_TK: np.ndarray, tokens_per_gpu: int, num_experts: int, capacity: int) -> np.ndarray:
    """bool [T, K]: rows kept when each source GPU (B consecutive tokens) keeps its first `capacity` rows
    per expert in routed-row order (token by token, k within a token)."""
    T, K = ids_TK.shape
    key_N = (np.arange(T * K) // (tokens_per_gpu * K)) * num_experts + ids_TK.reshape(-1)
    order = np.argsort(key_N, kind="stable")
    sorted_key = key_N[order]
    first = np.searchsorted(sorted_key, sorted_key, side="left")
    rank_N = np.empty(T * K, dtype=np.int64)
    rank_N[order] = np.arange(T * K) - first
    return (rank_N < capacity).reshape(T, K)


def layer_loads(ids_TK: np.ndarray, plan_row: np.ndarray, cfg: SimConfig, num_experts: int,
                gpus_per_node: int) -> Dict[str, np.ndarray]:
    """Per GPU of one layer and step: active slots, rows, and all-to-all rows (intra/inter node, out/in)."""
    N, B = cfg.num_gpus, cfg.tokens_per_gpu
    T, K = ids_TK.shape
    P = len(plan_row)
    S = P // N
    count_E = np.bincount(plan_row, minlength=num_experts)
    first_E = np.zeros(num_experts + 1, dtype=np.int64)
    first_E[1:] = np.cumsum(count_E)
    slots_by_expert = np.argsort(plan_row, kind="stable")  # replicas of e: slots_by_expert[first_E[e]:...]
    src_N = np.repeat(np.arange(T) // B, K)
    e_N = ids_TK.reshape(-1)
    keep_N = np.ones(T * K, dtype=bool)
    if cfg.capacity_factor is not None:
        capacity = max(math.ceil(cfg.capacity_factor * B * K / num_experts), cfg.min_capacity)
        keep_N = capacity_keep(ids_TK, B, num_experts, capacity).reshape(-1)
    row_in_src_N = np.arange(T * K) % (B * K)
    pick_N = (row_in_src_N + src_N) % count_E[e_N]
    slot_N = slots_by_expert[first_E[e_N] + pick_N]
    dst_N = slot_N // S
    rows_P = np.bincount(slot_N[keep_N], minlength=P)
    out = {"rows": rows_P.reshape(N, S).sum(1), "active": (rows_P > 0).reshape(N, S).sum(1),
           "dropped": np.array(T * K - int(keep_N.sum()))}
    pair_NN = np.bincount(src_N[keep_N] * N + dst_N[keep_N], minlength=N * N).reshape(N, N).astype(np.float64)
    if cfg.dispatcher == "capacity":  # C rows to every (destination GPU, slot), however many are routed
        pair_NN = np.full((N, N), float(capacity * S))
    np.fill_diagonal(pair_NN, 0.0)  # rows for a slot of the source GPU itself stay there
    node_G = np.arange(N) // gpus_per_node
    same_NN = node_G[:, None] == node_G[None, :]
    out["intra_out"], out["intra_in"] = (pair_NN * same_NN).sum(1), (pair_NN * same_NN).sum(0)
    out["inter_out"], out["inter_in"] = (pair_NN * ~same_NN).sum(1), (pair_NN * ~same_NN).sum(0)
    return out


def simulate(trace: RoutingTrace, cost: CostModel, cfg: SimConfig, plan: Optional[Plan] = None,
             replan: Optional[Callable[[np.ndarray], Plan]] = None, replan_every: int = 0) -> Dict:
    """Step times of `trace` on cfg.num_gpus GPUs under `plan` (None: the contiguous layout).

    replan (online re-balancing): every `replan_every` steps the placement becomes replan(load_LE) of
    the steps since the last re-plan, aligned to the current one (`migration.align`: fewest copies);
    the weights move between steps (their bytes are reported,
    not charged to the step time: a copy on a side stream, as the engine's re-balancer does)."""
    N, L = cfg.num_gpus, trace.num_layers
    plan = plan if plan is not None else contiguous_plan(L, trace.num_experts, N)
    window_LE = np.zeros((L, trace.num_experts))
    moved_slots = 0
    if plan.num_gpus != N or plan.phy2log_LP.shape[0] != L or plan.num_experts != trace.num_experts:
        raise ValueError(f"plan is for {plan.num_gpus} GPUs, {plan.phy2log_LP.shape[0]} layers, {plan.num_experts} "
                         f"experts; the simulation has {N} GPUs and a trace of {L} layers, {trace.num_experts} experts")
    curve = cost.local if N == 1 else cost.ep
    step_us, bal_us = np.zeros(cfg.num_steps), np.zeros(cfg.num_steps)
    phase_us = {"route": 0.0, "dispatch": 0.0, "experts": 0.0, "combine": 0.0}
    dropped = routed = 0
    for step in range(cfg.num_steps):
        if replan is not None and replan_every and step and step % replan_every == 0:
            new = align(plan, replan(window_LE))
            moved_slots += int((new.phy2log_LP != plan.phy2log_LP).sum())
            plan, window_LE = new, np.zeros_like(window_LE)
        rows = step_rows(trace, step, cfg)
        for layer in range(L):
            window_LE[layer] += np.bincount(trace.topk_ids_LTK[layer, rows].reshape(-1), minlength=trace.num_experts)
            ld = layer_loads(trace.topk_ids_LTK[layer, rows], plan.phy2log_LP[layer], cfg, trace.num_experts,
                             cost.gpus_per_node)
            experts_G = curve.time_us(ld["active"], ld["rows"])
            if N > 1:
                a2a_G = cost.a2a_us(*(ld[k] * cost.row_bytes for k in ("intra_out", "intra_in", "inter_out", "inter_in")))
            else:
                a2a_G = np.zeros(1)
            phases = {"route": np.full(N, cost.route_us), "dispatch": cost.dispatch_factor * a2a_G,
                      "experts": experts_G, "combine": cost.combine_factor * a2a_G}
            for name, t_G in phases.items():
                phase_us[name] += float(t_G.max())
                step_us[step] += float(t_G.max())
                bal_us[step] += float(t_G.mean())
            dropped += int(ld["dropped"])
            routed += rows.size * trace.top_k
    tokens = N * cfg.tokens_per_gpu
    mean_us = float(step_us.mean())
    return {
        "num_gpus": N, "num_nodes": math.ceil(N / cost.gpus_per_node), "tokens_per_gpu": cfg.tokens_per_gpu,
        "step_us": mean_us, "step_us_per_step": [round(float(v), 2) for v in step_us],
        "straggler_share": float(1.0 - bal_us.sum() / step_us.sum()),
        "throughput_tok_s": tokens / (mean_us * 1e-6), "throughput_tok_s_per_gpu": cfg.tokens_per_gpu / (mean_us * 1e-6),
        "phase_share": {k: v / step_us.sum() for k, v in phase_us.items()},
        "dropped_frac": dropped / max(routed, 1), "num_redundant": plan.num_redundant,
        "memory_overhead": plan.memory_overhead, "moved_expert_bytes": moved_slots * cost.expert_bytes,
    }
