"""Task `eplb`: placements for N GPUs from each trace (or load statistics), with what they buy and cost.

Per trace input and GPU count N: the contiguous layout (where E divides N), then EPLB with every
replica count R that keeps E + R a multiple of N (the fewest that give every GPU a slot, then + N
at a time) up to `lab.eplb.max_memory_overhead` x E. Planned on the first `plan_fraction` of the
trace's tokens, evaluated on the rest. Per (trace, N) the placement file of the smallest R that
meets the target imbalance (else the best tried) is written under `placements/`.
"""
from __future__ import annotations

import os
from typing import Dict, List

from moe_infer.experiments import TASKS
from moe_infer.experiments.common import out_dir, print_written, split_load, trace_input, write_run_info
from moe_infer.lab import plots
from moe_infer.lab.eplb import contiguous_plan, plan_auto
from moe_infer.lab.loads import imbalance
from moe_infer.lab.plan_eval import evaluate, model_wide_plan, write_placement
from moe_infer.lab.report import Section, save_section, write_report
from moe_infer.lab.tables import write_table

COLUMNS = ["trace", "num_gpus", "plan_nodes", "planner", "num_redundant", "memory_overhead", "imbalance_mean",
           "imbalance_max", "imbalance_planned_on", "meets_target"]


def replica_counts(num_experts: int, num_gpus: int, max_overhead: float, max_counts: int = 1 << 30) -> List[int]:
    """R with (E + R) % N == 0 and E + R >= N: the smallest, then + N while R <= max_overhead * E and a
    GPU's slots still hold distinct experts ((E + R) / N <= E)."""
    first = (-num_experts) % num_gpus
    if num_experts + first < num_gpus:
        first = num_gpus - num_experts
    counts = [first]
    while (len(counts) < max_counts and counts[-1] + num_gpus <= max_overhead * num_experts
           and (num_experts + counts[-1]) // num_gpus < num_experts):
        counts.append(counts[-1] + num_gpus)
    return counts


def plan_rows(label: str, plan_load, eval_load, cfg, trace_has_tokens: bool, out: str, layer_ids: List[int]) -> List[Dict]:
    L, E = eval_load.shape
    rows = []
    for N in cfg.num_gpus:
        base = None
        if E % N == 0:
            base = {"trace": label, "num_gpus": N, "planner": "contiguous",
                    **evaluate(contiguous_plan(L, E, N), eval_load)}
            base["imbalance_planned_on"] = None
            rows.append(base)
        tried = []
        for R in replica_counts(E, N, cfg.max_memory_overhead, cfg.max_replica_counts):
            plan = plan_auto(plan_load, N, R, cfg.gpus_per_node, cfg.hierarchical)
            row = {"trace": label, "num_gpus": N, "planner": "eplb", **evaluate(plan, eval_load, cfg.expert_bytes)}
            row["imbalance_planned_on"] = float(imbalance(plan.gpu_load(plan_load)).mean())
            row["meets_target"] = (row["imbalance_mean"] <= cfg.target_imbalance
                                   and row["memory_overhead"] <= cfg.target_memory + 1e-12)
            rows.append(row)
            tried.append((row, plan))
        hits = [t for t in tried if t[0]["imbalance_mean"] <= cfg.target_imbalance]
        best_row, best_plan = hits[0] if hits else min(tried, key=lambda t: t[0]["imbalance_mean"])
        wide = model_wide_plan(plan_load, N, best_plan.num_redundant, best_plan.num_nodes)
        rows.append({"trace": label, "num_gpus": N, "planner": "eplb_model_wide", **evaluate(wide, eval_load),
                     "imbalance_planned_on": float(imbalance(wide.gpu_load(plan_load)).mean())})
        if cfg.write_placements:
            os.makedirs(os.path.join(out, "placements"), exist_ok=True)
            name = f"placements/{label}_N{N}_R{best_plan.num_redundant}.json"
            write_placement(os.path.join(out, name), best_plan, wide,
                            {"trace": label, "imbalance_mean": best_row["imbalance_mean"],
                             "model_wide_imbalance_mean": rows[-1]["imbalance_mean"],
                             "memory_overhead": best_row["memory_overhead"],
                             "evaluated_on": "held-out tokens" if trace_has_tokens else "the planning statistics"},
                            layer_ids)
            best_row["placement_file"] = name
    return rows


@TASKS.register("eplb")
def eplb(job) -> List[Dict]:
    lab, out = job.lab, out_dir(job.lab)
    commit = write_run_info(out, job)["commit"]
    rows = []
    for name in lab.traces:
        src = trace_input(name, lab.synthetic)
        plan_load, eval_load = split_load(src.trace, src.load_LE, lab.eplb.plan_fraction)
        rows += plan_rows(src.label, plan_load, eval_load, lab.eplb, src.trace is not None, out, src.layer_ids)
    write_table(rows, out, "eplb")
    plots.imbalance_vs_replicas(rows, os.path.join(out, "imbalance_vs_replicas.png"),
                                lab.eplb.target_imbalance, lab.eplb.target_memory)
    c = lab.eplb
    section = Section(
        title="EPLB placements",
        text=(f"Commit {commit}. GPU imbalance (max - mean) / mean of each layer's GPU loads (a replicated expert's rows split evenly "
              f"over its replicas), mean and max over layers, on the {1 - c.plan_fraction:.0%} of each trace's tokens "
              f"the plan did not see (`imbalance_planned_on`: on the tokens it was planned on). Memory: replica slots "
              f"over logical experts; `plan_nodes`: the nodes the planner packed onto (1: one global pool). Target: imbalance <= {c.target_imbalance} with <= {c.target_memory:.0%} extra "
              f"expert memory. `eplb_model_wide`: one placement for every layer (what a placement file's `ranks` "
              f"gives the dispatcher), at the chosen replica count. {c.gpus_per_node} GPUs per node"
              f"{'; the hierarchical plan (nodes first) where it balances as well as the global one' if c.hierarchical else ', one global pool'}."),
        table=rows, columns=COLUMNS, images=["imbalance_vs_replicas.png"])
    save_section(section, out)
    write_report(out, "EPLB placements", [section])
    for r in rows:
        if r["planner"] != "eplb_model_wide":
            print(f"{r['trace']:>20} N={r['num_gpus']:>4} {r['planner']:>10} +{r['memory_overhead']:.1%} memory: "
                  f"imbalance {r['imbalance_mean']:.3f} (max layer {r['imbalance_max']:.3f})")
    print_written("eplb", out)
    return rows
