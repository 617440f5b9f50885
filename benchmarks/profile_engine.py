"""Where a generate step's time goes: per-step wall time for each (routing, experts) backend pair,
and a torch.profiler table of one decode-heavy generate call.

    python benchmarks/profile_engine.py [--tiny] [--batch 16] [--new-tokens 16] [--out X.json]

Uses the e2e benchmark's Qwen3-MoE-shaped random checkpoint (real dims, 4 layers). Prints the
tables; writes JSON (device named) to --out or $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import e2e_generate as e2e  # noqa: E402


def timed_generate(llm, prompts, num_new: int, device: torch.device) -> float:
    from moe_infer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    e2e.sync(device)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    e2e.sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from moe_infer import LLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = dict(e2e.TINY if args.tiny else e2e.REAL)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, dims["vocab_size"], (args.batch, 64), generator=gen).tolist()
    rows, table = [], ""
    with tempfile.TemporaryDirectory(prefix="prof_ckpt_") as ckpt:
        del_hf = e2e.build_checkpoint(dims, dtype, device, ckpt)
        del del_hf
        torch.cuda.empty_cache() if device.type == "cuda" else None
        pairs = [("auto", "auto"), ("torch", "torch"), ("torch", "auto"), ("auto", "torch")]
        for routing, experts in pairs:
            llm = LLM(model=ckpt, dtype=str(dtype).split(".")[-1], device=str(device), max_num_seqs=64,
                      num_kv_blocks=256, routing_backend=routing, experts_backend=experts)
            timed_generate(llm, prompts[:2], 4, device)  # warm-up: compile kernels
            t_prefill = timed_generate(llm, prompts, 1, device)
            t_total = timed_generate(llm, prompts, args.new_tokens, device)
            b = llm.engine.runner.backends
            rows.append(dict(routing=b.routing, experts=b.experts, batch=args.batch, prefill_s=t_prefill,
                             decode_ms_per_step=1e3 * (t_total - t_prefill) / max(args.new_tokens - 1, 1)))
            print(rows[-1], flush=True)
            if (routing, experts) == ("auto", "auto"):
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    timed_generate(llm, prompts, args.new_tokens, device)
                key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                table += "\n" + prof.key_averages().table(sort_by=key, row_limit=20)
                print(table, flush=True)
            del llm
            torch.cuda.empty_cache() if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = args.out or os.path.join(os.environ.get("OUT", "."), "profile_engine.json")
    with open(out, "w") as f:
        json.dump(dict(device=name, dims={k: v for k, v in dims.items() if k != "rope_parameters"},
                       rows=rows, profile=table), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
