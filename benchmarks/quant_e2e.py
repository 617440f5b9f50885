"""End-to-end quantization figures: decode throughput of the engine per weight format, and the perplexity of the
shipped tiny trained model per format.

  speed   output tokens/s of `LLM.generate` (greedy, EOS ignored, prefill of a short prompt included) at batch 1, 16
          and 64, bf16 against fp8 and int4 quantized at load (`quantization=`); Qwen3-30B-A3B's layer shape, 8
          layers, random weights (`load_format="dummy"`: the formats' kernels and bytes, not their accuracy)
  ppl     perplexity of moe_infer/assets/tiny_moe on held-out text (the Python standard library's validation files,
          moe_infer/experiments/heldout.py), teacher-forced (moe_infer/experiments/scoring.py), per format, with its
          ratio to the unquantized model's and the bound it should keep (fp8 1 %, int4 5 %: PPL_BOUNDS)

    python benchmarks/quant_e2e.py [--out X.json]                 # one GPU
    TRITON_INTERPRET=1 python benchmarks/quant_e2e.py --tiny      # CPU: tiny dims, a smoke run

Writes JSON (device named) to --out, else $OUT/quant_e2e_<device>.json, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from e2e_generate import REAL, TINY, device_label, time_ours, write_config, write_result  # noqa: E402

FORMATS = (None, "fp8", "int4")  # None: the checkpoint's bf16


def speed(dims: dict, device: torch.device, batches, prompt_len: int, num_new: int) -> list:
    from moe_infer import LLM

    rows = []
    gen = torch.Generator().manual_seed(0)
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    with tempfile.TemporaryDirectory(prefix="quant_e2e_") as ckpt:
        write_config(dims, ckpt)
        blocks = max(batches) * math.ceil((prompt_len + num_new + 16) / 16) + 16
        for fmt in FORMATS:
            t0 = time.perf_counter()
            llm = LLM(model=ckpt, dtype=dtype, device=str(device), load_format="dummy", quantization=fmt,
                      max_num_seqs=max(batches), max_num_batched_tokens=max(2048, prompt_len * max(batches)),
                      max_model_len=prompt_len + num_new + 16, num_kv_blocks=blocks)
            t_load = time.perf_counter() - t0
            for b in batches:
                other = torch.randint(2, dims["vocab_size"], (b, prompt_len), generator=gen).tolist()
                time_ours(llm, other, 3, device)  # compiles, captures
                prompts = torch.randint(2, dims["vocab_size"], (b, prompt_len), generator=gen).tolist()
                t, _ = time_ours(llm, prompts, num_new, device)
                rows.append(dict(format=fmt or "bf16", batch=b, prompt_len=prompt_len, new_tokens=num_new,
                                 seconds=t, tok_s=b * num_new / t, load_s=t_load))
                print(f"{fmt or 'bf16':>5} batch {b:>3}: {b * num_new / t:9.1f} tok/s")
            del llm
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


PPL_BOUNDS = {"fp8": 1.01, "int4": 1.05}  # a format's perplexity at most this times bf16's


@torch.inference_mode()
def perplexity(device: torch.device, seq_len: int, num_windows: int, per_forward: int, formats=FORMATS) -> list:
    """Rows (format, ppl, ratio to the first format's, bound, within) of the shipped tiny model on held-out text."""
    from moe_infer.assets import default_model_path
    from moe_infer.config import RoutingConfig
    from moe_infer.engine.llm_engine import load_tokenizer
    from moe_infer.experiments import heldout
    from moe_infer.experiments.scoring import PrefillScorer, perplexity as score

    path = default_model_path()
    windows = heldout.token_windows(load_tokenizer(path), heldout.stdlib_validation(), seq_len, num_windows)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rows = []
    for fmt in formats:
        scorer = PrefillScorer(path, RoutingConfig(), per_forward, seq_len, str(device), dtype, quantization=fmt)
        ppl, count = score(scorer, windows)
        ratio = ppl / rows[0]["ppl"] if rows else 1.0
        bound = PPL_BOUNDS.get(fmt)
        rows.append(dict(format=fmt or str(dtype).replace("torch.", ""), ppl=ppl, tokens=count, ratio=ratio,
                         bound=bound, within=None if bound is None else ratio <= bound))
        print(f"tiny_moe {rows[-1]['format']:>8}: perplexity {ppl:8.4f} over {count} tokens, x{ratio:.4f} of "
              f"{rows[0]['format']}" + (f" (bound x{bound}: {'ok' if ratio <= bound else 'OVER'})" if bound else ""))
        del scorer
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (TRITON_INTERPRET=1 not needed)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-ppl", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny on the CPU")
    dims = dict(TINY if args.tiny else REAL, num_hidden_layers=2 if args.tiny else args.layers)
    result = dict(benchmark="quant_e2e", device=device_label(device), torch=torch.__version__,
                  model=dict(family="qwen3_moe", **{k: v for k, v in dims.items() if k != "rope_parameters"}))
    if not args.skip_speed:
        result["speed"] = speed(dims, device, (1, 2) if args.tiny else (1, 16, 64), 8 if args.tiny else 32,
                                4 if args.tiny else 64)
    if not args.skip_ppl:
        result["ppl"] = perplexity(device, 64 if args.tiny else 512, 2 if args.tiny else 32, 2 if args.tiny else 8)
    print(json.dumps(result, indent=1)[:2000])
    write_result(result, f"quant_e2e_{device_label(device)}{'_tiny' if args.tiny else ''}.json", args.out)


if __name__ == "__main__":
    main()
