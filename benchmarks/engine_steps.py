"""Per-step cost of the engine on a GPU: what the start-up kernel warm-up buys, where host time goes.

Same model as `e2e_generate.py` (Qwen3-MoE-shaped, real dimensions, 4 layers, random weights). Each
arm runs in a fresh process with an empty Triton cache, so JIT compiles show up where they happen:
- `warmup` / `no_warmup`: CUDA-graph decode with the start-up warm-ups (`DecodeGraphs.warmup` and the
  runner's `moe_infer.engine.warmup`) on (the default) or off. A
  batch-16 generate warms up, then a batch-64 generate of 64 tokens is timed step by step (the first
  64-sequence decode step meets a new capture size). Reports engine load time, the slowest step,
  the median step and the host time of `ModelRunner.prepare` per step.
- `eager`: enforce_eager=True, batch 1: ms per decode step and kernel launches per step
  (torch.profiler: cudaLaunchKernel + cuLaunchKernelEx), divided by the layer count.

    python benchmarks/engine_steps.py [--out DIR]        # GPU, ~3 min on an H100
Writes engine_steps_<device>.json to --out, else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.e2e_generate import REAL, build_checkpoint, device_label, sync, time_ours  # noqa: E402


def _timed_steps(llm):
    """Wraps engine.step and runner.prepare with timers; returns (step seconds list, prepare seconds list)."""
    steps, prepares = [], []
    step, prepare = llm.engine.step, llm.engine.runner.prepare

    def timed_step(*a, **kw):
        sync(torch.device("cuda"))
        t = time.perf_counter()
        out = step(*a, **kw)
        sync(torch.device("cuda"))
        steps.append(time.perf_counter() - t)
        return out

    def timed_prepare(plan):
        t = time.perf_counter()
        out = prepare(plan)
        prepares.append(time.perf_counter() - t)
        return out

    llm.engine.step, llm.engine.runner.prepare = timed_step, timed_prepare
    return steps, prepares


def run_arm(arm: str) -> dict:
    from moe_infer import LLM
    from moe_infer.engine import model_runner
    from moe_infer.engine.cuda_graph import DecodeGraphs

    if arm == "no_warmup":
        DecodeGraphs.warmup = lambda self: None
        model_runner.warm_up_runner = lambda runner: None
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="steps_ckpt_") as ckpt:
        build_checkpoint(dict(REAL), torch.bfloat16, dev, ckpt)
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        llm = LLM(model=ckpt, dtype="bfloat16", device="cuda", max_num_seqs=64, max_num_batched_tokens=4096,
                  max_model_len=208, enforce_eager=arm == "eager")
        load_s = time.perf_counter() - t0
        if arm == "eager":
            prompt = torch.randint(2, REAL["vocab_size"], (1, 128), generator=gen).tolist()
            time_ours(llm, prompt, 4, dev)
            steps, _ = _timed_steps(llm)
            time_ours(llm, prompt, 16, dev)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            n_steps = 8
            with torch.profiler.profile(activities=acts) as prof:
                time_ours(llm, prompt, n_steps, dev)
            launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx"))
            decode = sorted(steps[1:16])
            return dict(arm=arm, load_s=load_s, decode_step_ms_median=1e3 * decode[len(decode) // 2],
                        launches_per_step=launches / n_steps,
                        launches_per_layer_step=launches / n_steps / REAL["num_hidden_layers"])
        time_ours(llm, torch.randint(2, REAL["vocab_size"], (16, 128), generator=gen).tolist(), 3, dev)
        steps, prepares = _timed_steps(llm)
        time_ours(llm, torch.randint(2, REAL["vocab_size"], (64, 128), generator=gen).tolist(), 64, dev)
        ordered = sorted(steps)
        return dict(arm=arm, load_s=load_s, batch=64, steps=len(steps), max_step_ms=1e3 * max(steps),
                    median_step_ms=1e3 * ordered[len(ordered) // 2], step_ms=[1e3 * s for s in steps],
                    prepare_us_median=1e6 * sorted(prepares)[len(prepares) // 2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # internal: one arm, JSON on stdout
    args = ap.parse_args()
    if args.arm:
        print("ARM_RESULT " + json.dumps(run_arm(args.arm)), flush=True)
        return
    rows = []
    for arm in ("no_warmup", "warmup", "eager"):
        with tempfile.TemporaryDirectory(prefix="triton_cache_") as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--arm", arm], env=env,
                                 capture_output=True, text=True, check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ARM_RESULT ")), None)
        if line is None:
            raise RuntimeError(f"arm {arm} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        rows.append(json.loads(line[len("ARM_RESULT "):]))
        r = rows[-1]
        print(f"{arm:10s} load {r['load_s']:6.1f} s  " + (
            f"decode step {r['decode_step_ms_median']:.1f} ms, {r['launches_per_layer_step']:.0f} launches/layer"
            if arm == "eager" else
            f"batch 64: max step {r['max_step_ms']:7.1f} ms, median {r['median_step_ms']:5.2f} ms, "
            f"prepare {r['prepare_us_median']:.0f} us"), flush=True)
    dev = torch.device("cuda")
    result = dict(benchmark="engine_steps", device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                  model=dict(family="qwen3_moe", **{k: v for k, v in REAL.items() if k != "rope_parameters"}),
                  triton_cache="empty per arm (fresh process)", rows=rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"engine_steps_{device_label(dev)}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
