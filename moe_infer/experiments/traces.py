"""Tasks that write routing traces: `record_trace` (the engine on held-out text) and `synthetic_trace`."""
from __future__ import annotations

import dataclasses
import os
import platform

from moe_infer.experiments import TASKS
from moe_infer.experiments.common import heldout_windows, out_dir, write_run_info
from moe_infer.lab import plots
from moe_infer.lab.loads import expert_load, imbalance
from moe_infer.lab.report import Section, save_section, write_report
from moe_infer.lab.synthetic import generate
from moe_infer.lab.tables import write_table
from moe_infer.routing.trace import RoutingTrace, save_trace


def summarize(trace: RoutingTrace, out: str, label: str, file_name: str) -> Section:
    """Per-layer load table, heatmap and report page of a trace written to `out`."""
    load_LE = expert_load(trace)
    rows = [{"layer": layer, "tokens": trace.num_tokens, "imbalance": float(imb),
             "max_over_mean": float(load.max() / max(load.mean(), 1e-30)),
             "min_over_mean": float(load.min() / max(load.mean(), 1e-30)), "load": load.astype(int).tolist()}
            for layer, load, imb in zip(trace.moe_layers, load_LE, imbalance(load_LE))]
    write_table(rows, out, "expert_load")
    plots.load_heatmap(load_LE, os.path.join(out, "load_heatmap.png"),
                       f"{label}: expert load per layer ({trace.num_tokens} tokens)", trace.moe_layers)
    section = Section(
        title=f"Routing trace: {label}",
        text=(f"`{file_name}`: {trace.num_tokens} tokens x {trace.num_layers} MoE layers, {trace.num_experts} "
              f"experts, top-{trace.top_k}, {int(trace.step_T.max()) + 1 if trace.num_tokens else 0} steps. "
              f"Imbalance = (max - mean) / mean of the rows per expert."),
        table=rows, columns=["layer", "tokens", "imbalance", "max_over_mean", "min_over_mean"],
        images=["load_heatmap.png"])
    save_section(section, out)
    write_report(out, f"Routing trace: {label}", [section])
    return section


@TASKS.register("record_trace")
def record_trace(job) -> RoutingTrace:
    from moe_infer.engine.llm import LLM
    from moe_infer.engine.sampling_params import SamplingParams

    lab, out = job.lab, out_dir(job.lab)
    cfg = job.engine_config()
    cfg.routing = dataclasses.replace(cfg.routing, trace=True, trace_logits=lab.record.logits)
    write_run_info(out, job)
    llm = LLM.from_config(cfg)
    windows = heldout_windows(job, llm.get_tokenizer())
    params = SamplingParams(max_tokens=lab.record.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": w.tolist()} for w in windows], params, use_tqdm=False)
    trace = None
    if llm.engine.parallel.is_driver:
        path = os.path.join(out, lab.record.out)
        trace = llm.save_routing_trace(path, prompts={"kind": "held-out windows", "data": vars(lab.data),
                                                      "python": platform.python_version()},
                                       new_tokens_per_prompt=lab.record.max_tokens,
                                       max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens)
        summarize(trace, out, "engine", lab.record.out)
        print(f"routing trace of {trace.num_tokens} tokens -> {path}")
    llm.shutdown()
    return trace


@TASKS.register("synthetic_trace")
def synthetic_trace(job) -> RoutingTrace:
    lab, out = job.lab, out_dir(job.lab)
    write_run_info(out, job)
    trace = generate(lab.synthetic)
    path = os.path.join(out, lab.record.out)
    save_trace(trace, path)
    summarize(trace, out, f"synthetic {lab.synthetic.pattern}", lab.record.out)
    print(f"synthetic {lab.synthetic.pattern} trace of {trace.num_tokens} tokens -> {path}")
    return trace
