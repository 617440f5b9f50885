"""Task `simulate`: each trace replayed over N GPUs with the cost model calibrated from benchmarks/results.

Policies per N: `dropless` (contiguous layout, where E divides N), `cf=<c>` (contiguous, the drop
policy at capacity factor c per source GPU, the capacity dispatcher), `eplb+<k>` (dropless, EPLB
placement with k extra slots per GPU beyond the fewest that give every GPU a slot, planned on the
trace's first `plan_fraction` of tokens), `eplb_online+<k>` (the same, re-planned every
`replan_every` steps on the steps since the last re-plan). The steps replay the rest of the trace. Also written:
the cost model (`cost_model.json`) and its check against the benchmarks it came from
(`calibration.csv/json`: one-GPU points, and the EP benchmark's 2- and 4-GPU rows, where 4 GPUs
were not used to fit the all-to-all).
"""
from __future__ import annotations

import os
from functools import partial
from typing import Dict, List

from moe_infer.experiments import TASKS
from moe_infer.experiments.common import (
    REPO_RESULTS, out_dir, print_written, split_load, trace_input, write_run_info,
)
from moe_infer.experiments.eplb_task import replica_counts
from moe_infer.lab import plots
from moe_infer.lab.calibration_check import ep_rows, single_gpu_rows
from moe_infer.lab.cost_model import calibrate
from moe_infer.lab.eplb import plan_auto
from moe_infer.lab.report import Section, save_section, write_report
from moe_infer.lab.simulate import SimConfig, simulate
from moe_infer.lab.tables import write_json, write_table

COLUMNS = ["trace", "policy", "num_gpus", "num_nodes", "step_us", "straggler_share", "throughput_tok_s",
           "dropped_frac", "memory_overhead"]


def _policies(E: int, N: int, cfg) -> List[tuple]:
    """(name, capacity factor or None, replicas or None, online) to simulate at N GPUs."""
    out = []
    if E % N == 0:
        out.append(("dropless", None, None, False))
        out += [(f"cf={cf:g}", cf, None, False) for cf in cfg.capacity_factors]
    first = replica_counts(E, N, 0.0)[0]
    for online, ks in ((False, cfg.replicas_per_gpu), (True, cfg.online_replicas_per_gpu)):
        out += [(f"eplb{'_online' if online else ''}+{k}", None, first + k * N, online) for k in ks
                if (E + first + k * N) // N <= E]
    return out


def simulate_trace(label: str, trace, cost, cfg) -> List[Dict]:
    plan_load, _ = split_load(trace, None, cfg.plan_fraction)
    start = int(round(cfg.plan_fraction * trace.num_tokens))
    rows = []
    for N in cfg.num_gpus:
        for name, cf, R, online in _policies(trace.num_experts, N, cfg):
            sim_cfg = SimConfig(num_gpus=N, tokens_per_gpu=cfg.tokens_per_gpu, num_steps=cfg.num_steps,
                                start_token=start, capacity_factor=cf,
                                dispatcher="capacity" if cf is not None else "exact")
            plan, replan = None, None
            if R is not None:
                plan = plan_auto(plan_load, N, R, cfg.gpus_per_node, cfg.hierarchical)
                if online:
                    replan = partial(plan_auto, num_gpus=N, num_redundant=R, gpus_per_node=cfg.gpus_per_node,
                                     hierarchical=cfg.hierarchical)
            res = simulate(trace, cost, sim_cfg, plan, replan, cfg.replan_every if online else 0)
            rows.append({"trace": label, "policy": name, **res})
    return rows


def gains(rows: List[Dict], num_gpus: int = 64, max_memory: float = 0.10) -> List[Dict]:
    """Per trace at num_gpus: the best EPLB policy's step time against the contiguous dropless one (or
    EPLB's fewest replicas where E < N), over all replica counts and within max_memory."""
    out = []
    for trace in sorted({r["trace"] for r in rows}):
        at = [r for r in rows if r["trace"] == trace and r["num_gpus"] == num_gpus]
        base = [r for r in at if r["policy"] == "dropless"] or [r for r in at if r["policy"] == "eplb+0"]
        eplb = [r for r in at if r["policy"].startswith("eplb")]
        if not base or not eplb:
            continue
        best = min(eplb, key=lambda r: r["step_us"])
        row = {"trace": trace, "num_gpus": num_gpus, "baseline": base[0]["policy"],
               "baseline_step_us": base[0]["step_us"], "best": best["policy"], "best_step_us": best["step_us"],
               "speedup": base[0]["step_us"] / best["step_us"], "memory_overhead": best["memory_overhead"]}
        cheap = [r for r in eplb if r["memory_overhead"] <= max_memory + 1e-12]
        if cheap:
            c = min(cheap, key=lambda r: r["step_us"])
            row.update({f"best_within_{max_memory:g}_memory": c["policy"],
                        f"speedup_within_{max_memory:g}_memory": base[0]["step_us"] / c["step_us"]})
        out.append(row)
    return out


@TASKS.register("simulate")
def simulate_task(job) -> List[Dict]:
    lab, out = job.lab, out_dir(job.lab)
    cfg = lab.simulate
    commit = write_run_info(out, job)["commit"]
    results_dir = cfg.results_dir or str(REPO_RESULTS)
    cost = calibrate(results_dir, cfg.shape, cfg.device, cfg.network_gbps, cfg.network_alpha_us, cfg.gpus_per_node)
    write_json(os.path.join(out, "cost_model.json"), cost.to_json())
    check = single_gpu_rows(cost, results_dir) + ep_rows(cost, results_dir)
    write_table(check, out, "calibration")
    rows = []
    for name in lab.traces:
        label, trace, _, _ = trace_input(name, lab.synthetic)
        if trace is None:
            raise ValueError(f"lab.traces entry {name!r}: the simulator replays traces, not load statistics")
        rows += simulate_trace(label, trace, cost, cfg)
    write_table(rows, out, "simulate")
    gain = gains(rows)
    write_table(gain, out, "gain_64")
    plots.step_time_vs_gpus(rows, os.path.join(out, "step_time_vs_gpus.png"))
    ratios = [c.get("layer_ratio") or c.get("ratio") for c in check]
    worst = max((max(r, 1 / r) for r in ratios if r), default=float("nan"))
    section = Section(
        title=f"Cluster simulation ({cost.shape} experts, {cost.device} calibration)",
        text=(f"Commit {commit}. MoE-layer time per step (all the MoE layers of each trace) with {cfg.tokens_per_gpu} "
              f"tokens per GPU, {cfg.num_steps} steps. Assumptions: " + "; ".join(cost.assumptions) + ". "
              f"Against the benchmarks (calibration.csv) the simulated times are within a factor {worst:.3f} "
              f"of the measured ones. Step-time gain of EPLB at 64 GPUs: " +
              "; ".join(f"{g['trace']} {g['speedup']:.2f}x ({g['best']}, +{g['memory_overhead']:.1%} memory, "
                        f"vs {g['baseline']})" for g in gain) + "."),
        table=rows, columns=COLUMNS, images=["step_time_vs_gpus.png"])
    save_section(section, out)
    write_report(out, "Cluster simulation", [section])
    for g in gain:
        print(f"{g['trace']}: at 64 GPUs {g['best']} {g['best_step_us'] / 1e3:.2f} ms vs {g['baseline']} "
              f"{g['baseline_step_us'] / 1e3:.2f} ms per step ({g['speedup']:.2f}x)")
    print_written("simulate", out)
    return rows
