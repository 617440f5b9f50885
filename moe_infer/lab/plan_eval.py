"""What a placement plan buys and costs: GPU imbalance before/after, replica memory, placement files.

`evaluate` scores a plan on a load it was not necessarily planned on (plan on the first part of a
trace, evaluate on the rest: that is what a deployment sees). `write_placement` writes the JSON
the EP dispatcher loads (`moe_infer.parallel.placement`): "ranks" is one placement for every
layer (planned on the layers' summed, per-layer-normalised load: what a layer without an entry of
its own uses); "layers" gives each layer its own plan; "info" says what it was planned on.

Legend: L MoE layers, E experts, N GPUs, P physical slots.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Sequence

import numpy as np

from moe_infer.lab.eplb import Plan, plan_eplb
from moe_infer.lab.loads import imbalance
from moe_infer.parallel.placement import ExpertPlacement


def evaluate(plan: Plan, load_LE: np.ndarray, expert_bytes: Optional[int] = None) -> Dict[str, Any]:
    """GPU-level imbalance of `plan` under `load_LE` (mean and max over layers) and its memory cost."""
    gpu_LN = plan.gpu_load(load_LE)
    imb_L = imbalance(gpu_LN)
    out = {
        "num_gpus": plan.num_gpus, "plan_nodes": plan.num_nodes, "num_redundant": plan.num_redundant,
        "slots_per_gpu": plan.slots_per_gpu, "memory_overhead": plan.memory_overhead,
        "imbalance_mean": float(imb_L.mean()), "imbalance_max": float(imb_L.max()),
        "imbalance_per_layer": [round(float(v), 4) for v in imb_L],
        "max_replicas": int(plan.count_LE().max()),
    }
    if expert_bytes is not None:  # per MoE layer and GPU: what the replicas add to the expert weights
        out["replica_bytes_per_gpu"] = int((plan.slots_per_gpu - plan.num_experts / plan.num_gpus)
                                           * expert_bytes * plan.phy2log_LP.shape[0])
    return out


def model_wide_plan(load_LE: np.ndarray, num_gpus: int, num_redundant: int = 0, num_nodes: int = 1,
                    num_groups: Optional[int] = None) -> Plan:
    """One plan for all layers (what a single placement file gives): planned on the sum over layers of
    each layer's load normalised to sum 1, so every layer weighs the same."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    share_E = (load_LE / np.maximum(load_LE.sum(1, keepdims=True), 1e-30)).sum(0, keepdims=True)
    one = plan_eplb(share_E, num_gpus, num_redundant, num_nodes, num_groups)
    return Plan(np.repeat(one.phy2log_LP, load_LE.shape[0], axis=0), one.num_experts, num_gpus, num_nodes)


def placements(plan: Plan) -> list:
    """One validated `ExpertPlacement` per layer of the plan."""
    S = plan.slots_per_gpu
    return [ExpertPlacement(plan.num_experts, plan.num_gpus,
                            tuple(tuple(int(e) for e in row[g * S:(g + 1) * S]) for g in range(plan.num_gpus)))
            for row in plan.phy2log_LP]


def write_placement(path: str, per_layer: Plan, model_wide: Plan, info: Optional[Dict[str, Any]] = None,
                    layer_ids: Optional[Sequence[int]] = None) -> None:
    """The placement file: "ranks" from `model_wide` (layer 0; all its layers are equal), "layers" from
    `per_layer`, keyed by the model's layer index of each plan row (`layer_ids`, default 0..L-1).
    Both are validated (every expert placed, no expert twice on a rank)."""
    if (per_layer.num_experts, per_layer.num_gpus) != (model_wide.num_experts, model_wide.num_gpus):
        raise ValueError("the per-layer and model-wide plans must have the same experts and GPUs")
    shared = placements(Plan(model_wide.phy2log_LP[:1], model_wide.num_experts, model_wide.num_gpus))[0]
    data = json.loads(shared.to_json())
    ids = list(range(per_layer.phy2log_LP.shape[0])) if layer_ids is None else list(layer_ids)
    if len(ids) != per_layer.phy2log_LP.shape[0]:
        raise ValueError(f"{len(ids)} layer ids for a plan of {per_layer.phy2log_LP.shape[0]} layers")
    data["layers"] = {str(i): [list(s) for s in p.slots] for i, p in zip(ids, placements(per_layer))}
    data["info"] = info or {}
    with open(path, "w") as f:
        json.dump(data, f)
