"""Speculative decoding: decode tokens/s with and without it, batch 1 / 4 / 16, greedy.

Workloads (each prompt asks for text that is largely in it, or continues a repeated pattern):
  ngram   the shipped tiny model (moe_infer/assets/tiny_moe, trained weights, its tokenizer) on prompts that repeat
          or edit text given in the prompt; speculation: n-gram (prompt lookup), adaptive k <= 4.
  draft   a larger random-weight Qwen3-MoE (`model.load_format=dummy`) of the tiny model's vocabulary and tokenizer,
          the tiny model as its draft (k <= 3), the same prompts: what a draft costs when it is mostly wrong (a
          random target shares nothing with it), and what adaptive k saves then.
  ngram_large  the large random target with n-gram speculation (its greedy output falls into loops).
Decode tok/s = B x (new - 1) / (time of `generate` with new tokens - time with 1 token): prefill left out. Each
configuration is warmed up first. Reports the acceptance rate, the mean accepted length (tokens a verifying
sequence-step emits) and the speed-up over the plain engine; with speculation, the verify steps replayed as graphs,
adaptive k's measured step times per k at the batch, and how many steps were launched with async scheduling
(lookahead) and how many steps in flight were collected early for a verify step (drains).

    python benchmarks/speculative.py            # GPU (one H200): the large target has Qwen3-30B-A3B's layer shape
    python benchmarks/speculative.py --tiny     # CPU: small shapes, few tokens, a smoke run
    python benchmarks/speculative.py --workloads ngram      # one workload (its own JSON file)

Writes speculative_<device>.json to --out DIR, else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from e2e_generate import device_label, sync, write_result  # noqa: E402

PASSAGE = ("The engine schedules the sequences of a step, the model runner lays their tokens out and runs the "
           "model, and the sampler draws the next token of each sequence from its logits. ")
PROMPTS = [
    f"Repeat this text exactly.\nText: {PASSAGE}\nRepeated: ",
    ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
     "def mul(a, b):\n    return a * b\n\n\n"),
    f"Fix the spelling and copy the rest.\nText: {PASSAGE.replace('sequence', 'sequnce')}\nFixed: ",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, ",
]
WORKLOADS = "ngram,draft,ngram_large"
LARGE = dict(  # Qwen3-30B-A3B's layer shape, 8 layers, the tiny model's vocabulary
    hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
)
LARGE_TINY = dict(  # --tiny: still a few times the tiny model's width
    hidden_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    num_experts=16, num_experts_per_tok=2, moe_intermediate_size=192, intermediate_size=512,
)


def large_target(dims: dict, out_dir: str) -> str:
    """A config-only Qwen3-MoE folder of the tiny model's vocabulary, with its tokenizer (weights: dummy)."""
    from transformers import Qwen3MoeConfig

    from moe_infer.assets import default_model_path

    tiny = default_model_path()
    with open(os.path.join(tiny, "config.json")) as f:
        base = json.load(f)
    config = Qwen3MoeConfig(vocab_size=base["vocab_size"], max_position_embeddings=base["max_position_embeddings"],
                            eos_token_id=base["eos_token_id"], bos_token_id=base["bos_token_id"],
                            pad_token_id=base["pad_token_id"], norm_topk_prob=True, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **dims)
    config.save_pretrained(out_dir)
    for f in os.listdir(tiny):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny, f), out_dir)
    return out_dir


def measure(llm, prompts, batch: int, new: int) -> dict:
    from moe_infer import SamplingParams

    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        sync(llm.engine.device)
        start = time.perf_counter()
        llm.generate(batch_prompts, params, use_tqdm=False)
        sync(llm.engine.device)
        return time.perf_counter() - start

    run(new)  # warm-up: compiles, graph captures, the acceptance average and the step costs settle
    graphs, spec = llm.engine.runner.graphs, llm.engine.speculator
    runs_before = graphs.verify_runs if graphs is not None else 0
    ahead = lambda: (getattr(llm.engine.executor, "num_lookahead_steps", 0),  # noqa: E731
                     spec.num_drains if spec is not None else 0)
    before, ahead_before = llm.engine.get_stats(), ahead()
    t_new, t_one = run(new), run(1)
    after, ahead_after = llm.engine.get_stats(), ahead()
    extra = {}
    if spec is not None:  # verify steps replayed as graphs; adaptive k's measured step times (ms) at this batch;
        from moe_infer.engine.speculative.cost import batch_bucket

        # steps launched with async scheduling (behind the step in flight), steps in flight collected for a verify
        extra = dict(lookahead_steps=ahead_after[0] - ahead_before[0], drains=ahead_after[1] - ahead_before[1],
                     verify_graph_runs=(graphs.verify_runs if graphs is not None else 0) - runs_before,
                     step_ms_by_k={k: 1e3 * sec for (bucket, k), sec in sorted(spec.costs.seconds.items())
                                   if bucket == batch_bucket(batch)})
    proposed = after.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    verified = after.num_spec_verified - before.num_spec_verified
    return dict(batch=batch, new_tokens=new, seconds=t_new, prefill_seconds=t_one,
                decode_tok_s=batch * (new - 1) / max(t_new - t_one, 1e-9),
                proposed=proposed, accepted=accepted,
                acceptance_rate=accepted / proposed if proposed else 0.0,
                mean_accepted_length=1 + accepted / verified if verified else 0.0, **extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes, few tokens")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else benchmarks/results)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,4,16)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--workloads", default=WORKLOADS, help="a subset writes speculative_<device>_<subset>.json")
    args = ap.parse_args()

    from moe_infer import LLM
    from moe_infer.assets import default_model_path

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    batches = [int(b) for b in (args.batches or ("1,4" if args.tiny else "1,4,16")).split(",")]
    new = args.new_tokens or (8 if args.tiny else 128)
    tiny = str(default_model_path())
    large = large_target(LARGE_TINY if args.tiny else LARGE, tempfile.mkdtemp(prefix="spec_target_"))
    common = dict(dtype=dtype, device=str(device), max_num_seqs=max(batches), enable_prefix_caching=False,
                  max_model_len=1024, num_kv_blocks=None if device.type == "cuda" else 512)
    workloads = {
        "ngram": (dict(model=tiny), {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}),
        "draft": (dict(model=large, load_format="dummy"),
                  {"method": "draft", "num_speculative_tokens": 3, "draft_model": tiny}),
        "ngram_large": (dict(model=large, load_format="dummy"),
                        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}),
    }
    rows = []
    for name in args.workloads.split(","):
        model_kw, spec = workloads[name]
        for label, spec_cfg in (("off", None), ("on", spec)):
            llm = LLM(**model_kw, **common, speculative_config=spec_cfg)
            for b in batches:
                r = dict(workload=name, speculation=label, **measure(llm, PROMPTS, b, new))
                rows.append(r)
                costs = " ".join(f"k{k}={ms:.2f}" for k, ms in r.get("step_ms_by_k", {}).items())
                print(f"{name:12s} {label:3s} batch {b:3d}: {r['decode_tok_s']:9.1f} tok/s  acceptance "
                      f"{r['acceptance_rate']:.2f}  mean accepted length {r['mean_accepted_length']:.2f}"
                      + (f"  verify graph replays {r['verify_graph_runs']}  lookahead steps {r['lookahead_steps']}"
                         f"  drains {r['drains']}  step ms {costs}" if label == "on" else ""),
                      flush=True)
            del llm
            gc.collect()  # the engine's objects refer to each other: its KV cache and graphs go only now
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{'workload':12s} {'batch':>5s} {'off tok/s':>10s} {'on tok/s':>10s} {'speed-up':>8s} "
          f"{'accept':>6s} {'mean len':>8s}")
    for r in rows:
        if r["speculation"] == "on":
            base = next(x for x in rows if x["workload"] == r["workload"] and x["speculation"] == "off"
                        and x["batch"] == r["batch"])
            r["speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
            print(f"{r['workload']:12s} {r['batch']:5d} {base['decode_tok_s']:10.1f} {r['decode_tok_s']:10.1f} "
                  f"{r['speedup']:7.2f}x {r['acceptance_rate']:6.2f} {r['mean_accepted_length']:8.2f}")
    result = dict(device=device_label(device), dtype=dtype, tiny=args.tiny, new_tokens=new, batches=batches,
                  large_target=LARGE_TINY if args.tiny else LARGE, torch=torch.__version__, rows=rows)
    part = "" if args.workloads == WORKLOADS else "_" + args.workloads.replace(",", "+")  # a subset: its own file
    write_result(result, f"speculative_{device_label(device)}{part}.json", args.out and os.path.join(args.out, ""))


if __name__ == "__main__":
    main()
