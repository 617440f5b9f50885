"""The main job: `python -m moe_infer.launch [overrides]`, `torchrun ... -m moe_infer.launch`, or `moe-infer`.
`moe-infer serve [overrides]` (`python -m moe_infer.launch serve ...`) starts the OpenAI-compatible
server instead (moe_infer/server/launch.py).

Composes conf/config.yaml with Hydra, builds the engine, generates from the prompts and prints the
text, output tokens/s and the per-layer expert load. Under torchrun (parallel.tp, pp or ep > 1) every rank
runs its share of the model (docs/scaling.md) and rank 0 prints.
"""
from __future__ import annotations

import os
import sys
import time
from typing import List

import hydra
from omegaconf import DictConfig

from moe_infer import host_threads
from moe_infer.launch_config import CONF_DIR, JobConfig, to_job



def format_expert_load(load: List[dict], max_experts_shown: int = 16) -> str:
    lines = [f"{'layer':>5} {'imbalance':>9} {'entropy':>7}  routed rows per expert"]
    for row in load:
        routed = row["routed"]
        shown = " ".join(str(v) for v in routed[:max_experts_shown])
        more = f" ... (+{len(routed) - max_experts_shown})" if len(routed) > max_experts_shown else ""
        dropped = sum(row.get("dropped", []))
        drop_txt = f"  dropped={dropped}" if dropped else ""
        lines.append(f"{row['layer']:>5} {row['imbalance']:>9.2f} {row['entropy']:>7.3f}  {shown}{more}{drop_txt}")
    return "\n".join(lines)


def before_torch(job: JobConfig) -> dict:
    """What must be in the environment before torch loads (moe_infer/host_threads.py: the offload host threads'
    wait policy and pool size); what it added. Nothing once torch is loaded (a caller's process that imported it first)."""
    if "torch" in sys.modules:
        return {}
    cfg = job.engine_config()
    device_type = host_threads.device_type_of(cfg.model.device, host_threads.cuda_present())
    added = host_threads.wanted_env(cfg.offload, device_type)
    os.environ.update(added)
    return added


def run(job: JobConfig):
    """The job: generate (the outputs), or a load-balance lab task (what the task returns)."""
    before_torch(job)
    if job.task != "generate":  # moe_infer/experiments
        from moe_infer.experiments import run_task

        return run_task(job)
    from moe_infer import LLM, SamplingParams

    is_printer = int(os.environ.get("RANK", "0")) == 0
    params = SamplingParams(**vars(job.sampling))
    prompts = job.prompt_list() if is_printer else []  # rank 0 schedules; the others run its steps (and get no stdin)
    llm = LLM.from_config(job.engine_config())
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=is_printer and job.show_progress)
    elapsed = time.perf_counter() - start
    if is_printer:
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        for out in outputs:
            print("=" * 72)
            print(f"prompt: {out.prompt!r}  ({len(out.prompt_token_ids)} tokens)")
            print(f"{out.prompt}{out.outputs[0].text}")
            error = f": {out.outputs[0].error}" if out.outputs[0].error else ""
            print(f"[finish_reason={out.outputs[0].finish_reason}, {len(out.outputs[0].token_ids)} tokens{error}]")
        print("=" * 72)
        print(f"{len(outputs)} requests, {num_out} output tokens in {elapsed:.2f} s: "
              f"{num_out / max(elapsed, 1e-9):.1f} output tokens/s")
        if job.show_expert_load:
            print("per-layer expert load (rows routed to each expert over this run):")
            print(format_expert_load(llm.get_expert_load()))
        offload = llm.get_offload_stats()
        if offload:
            t = offload["total"]
            print(f"offload: hit rate {t['hit_rate']:.2f}, misses copied {t['copied']} / streamed {t['streamed']} / "
                  f"on the CPU {t['cpu']}, {t['gb_h2d']:.2f} GB to the GPU, pre-gate recall per token "
                  f"{t['prefetch_token_recall']:.2f}, host threads {offload['host_threads']}")
        if job.trace_out:
            trace = llm.save_routing_trace(job.trace_out, prompts=prompts)
            print(f"routing trace: {trace.num_tokens} tokens x {trace.num_layers} MoE layers -> {job.trace_out}")
    llm.shutdown()
    return outputs


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    job = to_job(cfg)
    outputs = run(job)
    if job.task != "generate":  # a lab task: it raised if it failed
        return
    failed = [o for o in outputs if o.outputs[0].finish_reason == "error"]
    if failed:  # a batch job whose requests failed must not look like a success
        print(f"{len(failed)} of {len(outputs)} requests failed", file=sys.stderr)
        raise SystemExit(1)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":  # `moe-infer serve ...`: the OpenAI-compatible server
        from moe_infer.server.launch import main as serve_main

        del sys.argv[1]
        serve_main()
        return
    _hydra_main()


if __name__ == "__main__":
    main()
