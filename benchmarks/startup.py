"""Start-up to the first token, cold and warm, in parts, each start a fresh process.

    python benchmarks/startup.py            # GPU: Qwen3-30B-A3B's layer shape, 8 layers, random bf16 weights
    python benchmarks/startup.py --tiny     # CPU: the tiny model in the repo
    python benchmarks/startup.py --compile-workers 0   # the warm-up's kernels compiled one at a time (A/B)

cold: empty Triton, TorchInductor and CUDA kernel caches (fresh folders), so every Triton kernel compiles; warm: a
second process on the same machine with the caches the cold one left. Each process times, from its spawn:
  interpreter   spawn to the first line of the child (Python start-up)
  imports       `import torch` and `from moe_infer import LLM`
  engine        `LLM(...)`, in the engine's named parts (moe_infer/engine/startup_timings.py says what each covers:
                parallel_init, cuda_init, plugins, transformers_import, hf_config, model_load, kv_cache, kernel_warmup,
                cuda_graphs, tokenizer, scheduler) and engine_other, the rest of `LLM(...)` (what no part covers)
  first request one prompt of 128 tokens, 16 new tokens: its time to first token and the whole call
  to first token  spawn to the first token of that request (the figure the targets are for)
Targets on one GPU: cold <= 45 s, warm <= 15 s. Writes startup_<device>.json to --out, else $OUT, else results/.
"""
from __future__ import annotations

import time

T_CHILD = time.time()  # the child's first line: what the interpreter took is this minus the spawn time

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Optional  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS_S = {"cold": 45.0, "warm": 15.0}
CACHE_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH")


def child(spec: dict) -> dict:
    """One start, timed in parts (runs in a fresh process)."""
    t0 = time.time()
    cached = sum(len(files) for _, _, files in os.walk(os.environ.get("TRITON_CACHE_DIR") or os.devnull))
    import torch

    from moe_infer import LLM, SamplingParams

    t1 = time.time()
    # The engine's defaults (graphs up to batch 256, warm-up up to 2048-token steps), as a user starts it.
    kw = dict(model=spec["model"], load_format="dummy", dtype="bfloat16") if spec["model"] else dict(num_kv_blocks=256)
    if spec["compile_workers"] is not None:
        kw["compile_workers"] = spec["compile_workers"]
    llm = LLM(**kw)
    t2 = time.time()
    parts = dict(llm.engine.startup_timings)
    prompt = torch.randint(2, llm.engine.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    t3 = time.time()
    ttft = out[0].metrics.time_to_first_token
    engine_s = t2 - t1
    return dict(interpreter_s=T_CHILD - spec["spawn"], imports_s=t1 - t0, engine_s=engine_s, **parts,
                engine_other_s=engine_s - sum(parts.values()), first_request_s=t3 - t2,
                first_request_ttft_s=ttft, to_first_token_s=t2 + ttft - spec["spawn"] if ttft is not None else None,
                device=str(llm.engine.device), tokens=len(out[0].outputs[0].token_ids),
                triton_cache_files_at_start=cached, engine_parts=list(parts))


def start(kind: str, model: str, caches: str, timeout: float, compile_workers: Optional[int] = None) -> dict:
    """Spawn one start in a fresh process with its caches under `caches` (kept between the cold and warm start)."""
    path = os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    env.update({var: os.path.join(caches, var.lower()) for var in CACHE_VARS})
    spec = dict(model=model, compile_workers=compile_workers, spawn=time.time())
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the {kind} start failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return dict(kind=kind, **json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny model in the repo on the CPU")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a start may take")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-workers", type=int, default=None,
                    help="model.compile_workers (default: the engine's, 0: the warm-up compiles one kernel at a time)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    sys.path.insert(0, HERE)
    from e2e_generate import REAL, device_label, write_config, write_result

    with tempfile.TemporaryDirectory(prefix="startup_") as tmp:  # Qwen3-30B-A3B's layer shape, 8 layers
        model = "" if args.tiny else write_config(dict(REAL, num_hidden_layers=8), os.path.join(tmp, "model"))
        caches = os.path.join(tmp, "caches")  # empty: the cold start compiles everything
        runs = [start(kind, model, caches, args.timeout, args.compile_workers) for kind in ("cold", "warm")]
    device = runs[0]["device"]
    label = device_label(__import__("torch").device(device))
    gpu = device != "cpu"
    result = dict(benchmark="startup", device=label, model="tiny_moe (repo)" if args.tiny else
                  "Qwen3-30B-A3B layer shape, 8 layers, random bf16 weights", runs=runs,
                  compile_workers=args.compile_workers,
                  targets_s=TARGETS_S if gpu else None,
                  met={r["kind"]: r["to_first_token_s"] <= TARGETS_S[r["kind"]] for r in runs} if gpu else None)
    print_table(result)
    write_result(result, f"startup_{label}.json", args.out)


def print_table(result: dict) -> None:
    """Seconds per part, one column per run; a part a run did not time is '-'."""
    runs = result["runs"]
    rows = ["interpreter_s", "imports_s", *dict.fromkeys(p for r in runs for p in r["engine_parts"]),
            "engine_other_s", "engine_s", "first_request_s", "to_first_token_s"]
    print(f"\nstart-up on {result['device']} ({result['model']}), seconds")
    print(f"{'':>18} " + " ".join(f"{r['kind']:>9}" for r in runs))
    for row in rows:
        print(f"{row[:-2]:>18} " + " ".join(f"{r[row]:>9.2f}" if r.get(row) is not None else f"{'-':>9}"
                                             for r in runs))
    if result["met"] is not None:
        print("targets (to first token): " + ", ".join(
            f"{k} <= {v:.0f} s: {'met' if result['met'][k] else 'missed'}" for k, v in result["targets_s"].items()))


if __name__ == "__main__":
    main()
