"""The simulator against the measurements: re-run each benchmark's configuration in the simulator.

For every single-GPU fused-experts point and every EP benchmark row (capacity dispatcher, the only
one timed under CUDA graphs) of the cost model's shape and device, simulate that many GPUs with
that many tokens each on a uniform synthetic trace of the shape's E and K (the benchmarks route
random tokens through a random router: close to uniform) and put the simulated phase times next
to the measured ones. The all-to-all and dispatch/combine factors are fitted on EP=2 only
(`cost_model.calibrate`), so the EP=4 rows are a check of the model, not of its fit.
"""
from __future__ import annotations

from typing import Dict, List

from moe_infer.lab.cost_model import CostModel, read_results
from moe_infer.lab.simulate import SimConfig, simulate
from moe_infer.lab.synthetic import SyntheticSpec, generate

PHASES = ("experts", "dispatch", "combine")


def _uniform_trace(cost: CostModel, tokens: int, seed: int):
    steps = 2
    spec = SyntheticSpec(pattern="uniform", num_experts=cost.num_experts, top_k=cost.top_k, num_layers=1,
                         num_steps=steps, tokens_per_step=tokens, seed=seed)
    return generate(spec)


def single_gpu_rows(cost: CostModel, results_dir: str) -> List[Dict]:
    """Simulated vs measured expert time of the one-GPU points (the fused benchmark and the EP
    benchmark's EP=1 rows: what the local curve was fitted on)."""
    measured = []
    for name, data in read_results(results_dir, "fused_moe_*.json"):
        if cost.device.lower() in data.get("device", "").lower() and "trial" not in name and "variants" not in name:
            measured += [(name, p["tokens"], p["ours_us"]) for p in data.get("points", [])
                         if p.get("shape") == cost.shape and p.get("ours_us")]
    for name, data in read_results(results_dir, "expert_parallel_*x*_ep1.json"):
        if cost.device.lower() in data.get("device", "").lower():
            measured += [(name, r["tokens_per_rank"], r["graph_us"]["experts"]) for r in data.get("results", [])
                         if r.get("model") == cost.shape and (r.get("graph_us") or {}).get("experts")]
    out = []
    for name, T, t_us in measured:
        sim = simulate(_uniform_trace(cost, T, seed=T), cost, SimConfig(num_gpus=1, tokens_per_gpu=T, num_steps=2))
        experts = sim["phase_share"]["experts"] * sim["step_us"]
        out.append({"source": name, "gpus": 1, "tokens_per_gpu": T, "measured_experts_us": t_us,
                    "simulated_experts_us": experts, "ratio": experts / t_us})
    return out


def ep_rows(cost: CostModel, results_dir: str) -> List[Dict]:
    """Simulated vs measured phases of the EP benchmark's capacity-dispatcher rows."""
    out = []
    for name, data in read_results(results_dir, "expert_parallel_*x*_ep*.json"):
        if cost.device.lower() not in data.get("device", "").lower():
            continue
        for r in data.get("results", []):
            g = r.get("graph_us") or {}
            if r.get("model") != cost.shape or r.get("backend") != "capacity" or not g.get("experts"):
                continue
            ep, T = r["ep"], r["tokens_per_rank"]
            cfg = SimConfig(num_gpus=ep, tokens_per_gpu=T, num_steps=2, capacity_factor=1.0, min_capacity=4,
                            dispatcher="capacity")
            sim = simulate(_uniform_trace(cost, ep * T, seed=ep * T), cost, cfg)
            row = {"source": name, "gpus": ep, "tokens_per_gpu": T, "fitted": ep == 2}
            total = sim["step_us"]
            for phase in PHASES:
                row[f"measured_{phase}_us"] = g.get(phase)
                row[f"simulated_{phase}_us"] = sim["phase_share"][phase] * total
            row["measured_layer_us"] = g.get("layer")
            row["simulated_layer_us"] = sum(row[f"simulated_{p}_us"] for p in PHASES)
            row["layer_ratio"] = row["simulated_layer_us"] / g["layer"] if g.get("layer") else None
            out.append(row)
    return out
