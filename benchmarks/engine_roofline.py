"""The engine end to end against its roofline and transformers: decode tok/s, prefill tok/s, TTFT.

    python benchmarks/engine_roofline.py                  # one GPU, ~4 min: 8-layer Qwen3-30B-A3B shape, bf16
    python benchmarks/engine_roofline.py --tiny           # CPU smoke run of the same code

Same checkpoint for both engines (e2e_generate.py's: random weights, router logits spread), greedy, EOS ignored.
Measured, each after a warm-up at the same shapes on other prompts:
  decode: batch 1 / 16 / 64, prompt 128, 128 new tokens; output tok/s = batch x new tokens / wall time of the whole
    generate call (prefill included, as the issue's table), and the share of ours' greedy tokens equal to HF's;
  prefill: 16 prompts of 1024 tokens, one new token: prompt tok/s (median of 3 calls);
  TTFT: one prompt of 128 and of 1024 tokens, one new token: the generate call's wall time (median of 5).
Ours runs with its defaults, and again with --compare-attention (default "sdpa") on the same prompts; --compare
KEY=VALUE (repeatable) adds an engine built with that LLM keyword (e.g. async_scheduling=false), ours_KEY_VALUE.
Rooflines from the model's dimensions, at the rates measured at the start (device_rates.py) unless --hbm-gbps /
--tflops are given:
  decode step bytes = per layer (attention + router weights + the experts touched + the K/V read) + LM head;
    experts touched at batch B = E * (1 - (1 - K/E)^B) (uniform routing: an estimate);
  decode roofline tok/s = B x new tokens / (new tokens decode steps' times), prefill excluded;
  prefill / TTFT limit = max(FLOPs / --tflops, weights touched / HBM rate).
Writes JSON (device named) to --out, else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import e2e_generate as e2e  # noqa: E402
from device_rates import measure_rates  # noqa: E402

TARGETS = {"decode_tok_s": {1: 1500, 16: 5000, 64: 13000}, "ttft_1024_ms": 5.0, "prefill_tok_s": 340_000}


def layer_weight_bytes(dims: dict, experts_touched: float, elem: int = 2) -> float:
    D, H, Hkv, d = dims["hidden_size"], dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    E, F = dims["num_experts"], dims["moe_intermediate_size"]
    attn = D * H * d + 2 * D * Hkv * d + H * d * D
    return elem * (attn + D * E + experts_touched * 3 * D * F)


def experts_touched(dims: dict, tokens: int) -> float:
    E, K = dims["num_experts"], dims["num_experts_per_tok"]
    return E * (1.0 - (1.0 - K / E) ** tokens)


def decode_step_bytes(dims: dict, batch: int, context: int) -> float:
    """Bytes a decode step of `batch` sequences of `context` keys reads (bf16): the layers' weights with the experts
    the batch touches, the LM head, the K/V."""
    L, Hkv, d, V, D = (dims["num_hidden_layers"], dims["num_key_value_heads"], dims["head_dim"],
                       dims["vocab_size"], dims["hidden_size"])
    kv = L * batch * context * 2 * Hkv * d * 2
    return L * layer_weight_bytes(dims, experts_touched(dims, batch)) + 2 * V * D + kv


def decode_roofline_s(dims: dict, batch: int, prompt: int, new: int, hbm: float) -> float:
    """Seconds of `new` decode-shaped steps at the HBM rate, one per output token (as the issue's table
    counts: the prefill's own time is not in the roofline), step i reading prompt + i keys."""
    return sum(decode_step_bytes(dims, batch, prompt + i) for i in range(new)) / hbm


def prefill_limit_s(dims: dict, seqs: int, prompt: int, hbm: float, flops: float) -> float:
    """max(compute, weights read) of one prefill of `seqs` prompts; logits of the last token only."""
    L, H, d, V, D = (dims["num_hidden_layers"], dims["num_attention_heads"], dims["head_dim"],
                     dims["vocab_size"], dims["hidden_size"])
    K = dims["num_experts_per_tok"]
    tokens = seqs * prompt
    active = layer_weight_bytes(dims, K) / 2  # parameters one token multiplies (K experts)
    causal_pairs = seqs * prompt * (prompt + 1) / 2
    fl = 2 * tokens * L * active + 4 * L * H * d * causal_pairs + 2 * seqs * V * D
    weights = L * layer_weight_bytes(dims, experts_touched(dims, tokens)) + 2 * V * D
    return max(fl / flops, weights / hbm)


def timed(llm, prompts, new: int, device) -> float:
    return e2e.time_ours(llm, prompts, new, device)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (a smoke run)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", default="16x1024", help="SEQSxLEN of the prefill measurement")
    ap.add_argument("--ttft", default="128,1024", help="prompt lengths of the TTFT measurement")
    ap.add_argument("--compare-attention", default="sdpa", help="'' to skip the second engine")
    ap.add_argument("--compare", action="append", default=[], metavar="KEY=VALUE",
                    help="another engine with this LLM keyword (true/false/ints parsed), e.g. async_scheduling=false")
    ap.add_argument("--hbm-gbps", type=float, default=None,
                    help="the roofline's memory rate (default: this GPU's copy rate, measured at the start)")
    ap.add_argument("--tflops", type=float, default=None,
                    help="the roofline's dense bf16 rate (default: this GPU's bf16 GEMM, measured at the start)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from moe_infer import LLM

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dims = dict(e2e.TINY if args.tiny else e2e.REAL)
    dims["num_hidden_layers"] = 2 if args.tiny else args.layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in ("1,4" if args.tiny else args.batches).split(",")]
    P, N = (16, 8) if args.tiny else (args.prompt_len, args.new_tokens)
    pf_seqs, pf_len = (2, 64) if args.tiny else tuple(int(v) for v in args.prefill.split("x"))
    ttft_lens = [16, 64] if args.tiny else [int(v) for v in args.ttft.split(",")]
    rates = measure_rates(device)
    hbm = (args.hbm_gbps or rates["hbm_gbps"]) * 1e9
    flops = (args.tflops or rates["tflops"]) * 1e12
    gen = torch.Generator().manual_seed(0)

    def ids(b: int, n: int) -> list:
        return torch.randint(2, dims["vocab_size"], (b, n), generator=gen).tolist()

    with tempfile.TemporaryDirectory(prefix="engine_roofline_") as ckpt:
        hf = e2e.build_checkpoint(dims, dtype, device, ckpt)
        longest = max(P + N, pf_len + 1, max(ttft_lens) + 1) + 16
        blocks = max(max(batches) * (P + N + 16), pf_seqs * (pf_len + 16)) // 16 + 64
        kw = dict(model=ckpt, dtype=str(dtype).split(".")[-1], device=str(device), max_num_seqs=max(batches),
                  max_num_batched_tokens=max(pf_seqs * pf_len, 2048), max_model_len=longest, num_kv_blocks=blocks,
                  enable_prefix_caching=False)
        engines = {"ours": LLM(**kw)}
        if args.compare_attention and device.type == "cuda":
            engines[f"ours_{args.compare_attention}"] = LLM(**kw, attention_backend=args.compare_attention)
        for item in args.compare:
            key, _, value = item.partition("=")
            engines[f"ours_{key}_{value}"] = LLM(**kw, **{key: parse_value(value)})
        result = dict(benchmark="engine_roofline", device=e2e.device_label(device), torch=torch.__version__,
                      git_commit=os.environ.get("GIT_COMMIT"),  # the device checkout has no git metadata
                      transformers=__import__("transformers").__version__, dtype=str(dtype),
                      model=dict(family="qwen3_moe", **{k: v for k, v in dims.items() if k != "rope_parameters"}),
                      attention={k: llm.engine.runner.model.layers[0].self_attn.backend for k, llm in engines.items()},
                      async_scheduling={k: llm.engine.scheduler.lookahead for k, llm in engines.items()},
                      roofline=dict(hbm_bytes_per_s=hbm, bf16_flops=flops, measured=rates),
                      targets=TARGETS, decode=[], ttft=[])

        for b in batches:
            warm, prompts = ids(b, P), ids(b, P)
            row = dict(batch=b, prompt_len=P, new_tokens=N)
            tokens = {}
            for name, llm in engines.items():
                timed(llm, warm, N, device)  # Triton compiles, graphs captured at every context bucket
                secs, tokens[name] = e2e.time_ours(llm, prompts, N, device)
                row[f"{name}_tok_s"] = b * N / secs
            e2e.time_hf(hf, warm, 3, device)
            hf_s, hf_tokens = e2e.time_hf(hf, prompts, N, device)
            row["hf_tok_s"] = b * N / hf_s
            # greedy tokens equal to transformers' (bf16 paths may part after a near tie: a figure, not a check)
            row["same_tokens_vs_hf"] = sum(x == y for a, c in zip(tokens["ours"], hf_tokens)
                                           for x, y in zip(a, c)) / (b * N)
            dec_s = decode_roofline_s(dims, b, P, N, hbm)
            row["roofline_tok_s"] = b * N / dec_s
            row["ours_pct_roofline"] = 100 * row["ours_tok_s"] / row["roofline_tok_s"]
            row["target_tok_s"] = TARGETS["decode_tok_s"].get(b)
            result["decode"].append(row)
            print(f"decode batch {b}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k.endswith("tok_s")
                                                    and v is not None), flush=True)

        warm, prompts = ids(pf_seqs, pf_len), ids(pf_seqs, pf_len)
        pf = dict(seqs=pf_seqs, prompt_len=pf_len)
        for name, llm in engines.items():
            timed(llm, warm, 1, device)
            # median of 3 (one 16 x 1024 step is ~45 ms: a single call is at the mercy of one hiccup)
            pf[f"{name}_tok_s"] = pf_seqs * pf_len / statistics.median(
                timed(llm, p, 1, device) for p in (prompts, ids(pf_seqs, pf_len), ids(pf_seqs, pf_len)))
        e2e.time_hf(hf, warm, 1, device)
        pf["hf_tok_s"] = pf_seqs * pf_len / e2e.time_hf(hf, prompts, 1, device)[0]
        pf["limit_tok_s"] = pf_seqs * pf_len / prefill_limit_s(dims, pf_seqs, pf_len, hbm, flops)
        pf["target_tok_s"] = TARGETS["prefill_tok_s"]
        result["prefill"] = pf
        print("prefill " + ", ".join(f"{k} {v:.0f}" for k, v in pf.items() if k.endswith("tok_s")), flush=True)

        for n in ttft_lens:
            row = dict(prompt_len=n)
            for name, llm in engines.items():
                timed(llm, ids(1, n), 1, device)
                row[f"{name}_ms"] = 1e3 * statistics.median(timed(llm, ids(1, n), 1, device) for _ in range(5))
            e2e.time_hf(hf, ids(1, n), 1, device)
            row["hf_ms"] = 1e3 * statistics.median(e2e.time_hf(hf, ids(1, n), 1, device)[0] for _ in range(5))
            row["limit_ms"] = 1e3 * prefill_limit_s(dims, 1, n, hbm, flops)
            result["ttft"].append(row)
            print(f"TTFT 1 x {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith("ms")), flush=True)
        result["cuda_graphs"] = e2e.cuda_graph_summary(engines["ours"])
        for llm in engines.values():
            llm.shutdown()

    result["targets_met"] = targets_met(result)
    print_table(result)
    e2e.write_result(result, f"engine_roofline_{result['device']}.json", args.out)


def parse_value(text: str):
    """A --compare value: true/false, an int, a float, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def targets_met(result: dict) -> dict:
    met = {f"decode_batch_{r['batch']}": r["ours_tok_s"] >= r["target_tok_s"] for r in result["decode"]
           if r["target_tok_s"]}
    met["prefill"] = result["prefill"]["ours_tok_s"] >= TARGETS["prefill_tok_s"]
    for r in result["ttft"]:
        if r["prompt_len"] == 1024:
            met["ttft_1024"] = r["ours_ms"] <= TARGETS["ttft_1024_ms"]
    return met


def print_table(result: dict) -> None:
    names = [k[:-6] for k in result["decode"][0] if k.endswith("_tok_s") and k.startswith("ours")]
    print(f"\n{result['device']}, qwen3_moe x{result['model']['num_hidden_layers']} layers, {result['dtype']}")
    print(f"{'decode':>12} " + " ".join(f"{n:>14}" for n in names) + f" {'HF':>9} {'roofline':>9} {'% roof':>7} {'target':>7}")
    for r in result["decode"]:
        print(f"{'batch ' + str(r['batch']):>12} " + " ".join(f"{r[n + '_tok_s']:>14.0f}" for n in names)
              + f" {r['hf_tok_s']:>9.0f} {r['roofline_tok_s']:>9.0f} {r['ours_pct_roofline']:>6.0f}% "
              f"{r['target_tok_s'] or '-':>7}")
    pf = result["prefill"]
    print(f"{'prefill':>12} " + " ".join(f"{pf[n + '_tok_s']:>14.0f}" for n in names)
          + f" {pf['hf_tok_s']:>9.0f} {pf['limit_tok_s']:>9.0f} {100 * pf['ours_tok_s'] / pf['limit_tok_s']:>6.0f}% "
          f"{pf['target_tok_s']:>7}")
    for r in result["ttft"]:
        print(f"{'TTFT ' + str(r['prompt_len']) + ' ms':>12} " + " ".join(f"{r[n + '_ms']:>14.2f}" for n in names)
              + f" {r['hf_ms']:>9.2f} {r['limit_ms']:>9.2f}")
    print(f"targets met: {result['targets_met']}")


if __name__ == "__main__":
    main()
