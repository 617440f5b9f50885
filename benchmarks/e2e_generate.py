"""End-to-end generation: output tokens/s of our engine vs transformers `generate`.

Same model (a Qwen3-MoE-shaped checkpoint with real dimensions and a few layers, random weights),
same prompts (random ids, equal lengths so HF needs no padding), greedy, a fixed output length
(EOS ignored on both sides), batch sizes 1, 16 and 64. Times include prefill; each batch size is
warmed up first on other prompts of the same shape (Triton compiles, CUDA graphs captured). Ours
runs with decode steps replayed as CUDA graphs (the default) and, on CUDA, also eagerly
(enforce_eager=True). Also reports how many of our greedy tokens equal HF's (bf16 greedy paths may
part ways after a near tie; not a check).

    python benchmarks/e2e_generate.py [--out X.json]      # GPU: real dims, ~2 min on an H100
    python benchmarks/e2e_generate.py --tiny               # CPU: tiny dims, a smoke run

Writes JSON (device named) to --out, else $OUT/e2e_generate_<device>.json, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

REAL = dict(  # Qwen3-30B-A3B's layer shape, 4 layers
    vocab_size=151936, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
    norm_topk_prob=True, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True,
    max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)


def device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace("NVIDIA ", "").replace(" ", "_").lower()


def build_checkpoint(dims: dict, dtype: torch.dtype, device: torch.device, out_dir: str):
    """Random-weight Qwen3-MoE saved as an HF folder; returns transformers' model (the baseline)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**dims, eos_token_id=0, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # HF's default init (std 0.02) gives near-uniform router logits: std 1.5 instead
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.5 / dims["hidden_size"] ** 0.5)
    model.save_pretrained(out_dir)
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def time_hf(model, prompts, num_new: int, device: torch.device):
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    sync(device)
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def time_ours(llm, prompts, num_new: int, device: torch.device):
    from moe_infer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def cuda_graph_summary(llm) -> dict:
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return dict(used=False)
    out = dict(used=graphs.disabled is None, disabled=graphs.disabled, decode_steps_replayed=graphs.runs,
               captured=sorted(graphs.graphs))
    extend = llm.engine.runner.extend_graphs
    if extend is not None:  # prefill and mixed steps
        out["extend"] = dict(used=extend.disabled is None, disabled=extend.disabled, steps_replayed=extend.runs,
                             captured=sorted(extend.graphs))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(fn, device: torch.device, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of fn(), synced before and after each call, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def clock_in_graph(fn, device: torch.device, calls: int = 20, reps: int = 5) -> float:
    """Seconds a call of fn takes as a CUDA graph runs it (a decode step's graph: no host time): `calls` calls
    captured in one graph after warm-up calls (one on a side stream), the graph's median replay / calls. thread_local
    capture, so that collectives capture too. Eager clock on the CPU."""
    if device.type != "cuda":
        return clock(fn, device)
    fn()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    return clock(graph.replay, device, reps=reps) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny dims (CPU smoke run)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64; tiny 1,4)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attention", default=None,
                        help="also time ours with this attention backend (e.g. triton: the paged kernel)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from moe_infer import LLM

    device = torch.device(args.device)
    dims = dict(TINY if args.tiny else REAL)
    if args.layers:
        dims["num_hidden_layers"] = args.layers
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batches = [int(b) for b in (args.batches or ("1,4" if args.tiny else "1,16,64")).split(",")]
    prompt_len = args.prompt_len or (16 if args.tiny else 128)
    num_new = args.new_tokens or (8 if args.tiny else 64)
    gen = torch.Generator().manual_seed(0)

    with tempfile.TemporaryDirectory(prefix="e2e_ckpt_") as ckpt:
        t0 = time.perf_counter()
        hf = build_checkpoint(dims, dtype, device, ckpt)
        t_build = time.perf_counter() - t0
        t0 = time.perf_counter()
        kw = dict(model=ckpt, dtype=str(dtype).split(".")[-1], device=str(device), max_num_seqs=max(batches),
                  max_num_batched_tokens=max(4096, prompt_len), max_model_len=prompt_len + num_new + 16)
        llm = LLM(**kw)  # decode steps replayed as CUDA graphs (the default on CUDA)
        t_load = time.perf_counter() - t0
        eager = LLM(**kw, enforce_eager=True) if device.type == "cuda" else None
        other_attn = LLM(**kw, attention_backend=args.attention) if args.attention else None
        backends = llm.engine.runner.backends
        rows = []
        for b in batches:
            # warm-up at this batch's shapes with other prompts (no prefix-cache hits later): Triton
            # specialises kernels on shape properties and compiles on first sight, HF's kernels warm too
            other = torch.randint(2, dims["vocab_size"], (b, prompt_len), generator=gen).tolist()
            time_ours(llm, other, 3, device)
            time_hf(hf, other, 3, device)
            prompts = torch.randint(2, dims["vocab_size"], (b, prompt_len), generator=gen).tolist()
            t_ours, tok_ours = time_ours(llm, prompts, num_new, device)
            t_hf, tok_hf = time_hf(hf, prompts, num_new, device)
            eager_row = {}
            if eager is not None:
                time_ours(eager, other, 3, device)
                t_eager, tok_eager = time_ours(eager, prompts, num_new, device)
                eager_row = dict(ours_eager_s=t_eager, ours_eager_tok_s=b * num_new / t_eager,
                                 same_tokens_graph_vs_eager=sum(x == y for a, c in zip(tok_ours, tok_eager)
                                                                for x, y in zip(a, c)) / (b * num_new))
            if other_attn is not None:
                time_ours(other_attn, other, 3, device)
                t_attn, tok_attn = time_ours(other_attn, prompts, num_new, device)
                eager_row.update(ours_attention=args.attention, ours_attention_tok_s=b * num_new / t_attn,
                                 same_tokens_attention_vs_default=sum(x == y for a, c in zip(tok_ours, tok_attn)
                                                                      for x, y in zip(a, c)) / (b * num_new))
            same = sum(x == y for a, c in zip(tok_ours, tok_hf) for x, y in zip(a, c))
            first = sum(a[0] == c[0] for a, c in zip(tok_ours, tok_hf))
            rows.append(dict(batch=b, prompt_len=prompt_len, new_tokens=num_new,
                             ours_s=t_ours, hf_s=t_hf, ours_tok_s=b * num_new / t_ours, hf_tok_s=b * num_new / t_hf,
                             speedup=t_hf / t_ours, same_tokens=same / (b * num_new), same_first_token=first / b,
                             **eager_row))
    label = device_label(device)
    result = dict(
        benchmark="e2e_generate", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, transformers=__import__("transformers").__version__, dtype=str(dtype),
        model=dict(family="qwen3_moe", **{k: v for k, v in dims.items() if k != "rope_parameters"}),
        backends=dict(routing=backends.routing, experts=backends.experts, policy=backends.policy),
        hf_experts_implementation=getattr(hf.config, "_experts_implementation", None) or "eager",
        num_kv_blocks=llm.engine.runner.num_kv_blocks, build_s=t_build, load_s=t_load, rows=rows,
        cuda_graphs=cuda_graph_summary(llm),
    )
    print(f"e2e generate, {result['device']}, {dtype}, qwen3_moe x{dims['num_hidden_layers']} layers "
          f"(D={dims['hidden_size']}, E={dims['num_experts']}, K={dims['num_experts_per_tok']}, "
          f"F={dims['moe_intermediate_size']}), prompt {prompt_len}, {num_new} new tokens, experts={backends.experts}")
    print(f"cuda graphs: {result['cuda_graphs']}")
    attn = f"{args.attention} tok/s" if args.attention else ""
    print(f"{'batch':>5} {'ours tok/s':>11} {'eager tok/s':>12} {attn:>14} {'HF tok/s':>10} {'speedup':>8} "
          f"{'same tok':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['ours_tok_s']:>11.1f} {r.get('ours_eager_tok_s', float('nan')):>12.1f} "
              f"{(format(r['ours_attention_tok_s'], '.1f') if args.attention else ''):>14} "
              f"{r['hf_tok_s']:>10.1f} {r['speedup']:>7.2f}x {r['same_tokens']:>8.0%}")
    write_result(result, f"e2e_generate_{label}{'_tiny' if args.tiny else ''}.json", args.out)


def write_result(result: dict, name: str, out: str = None) -> str:
    """The JSON to `out` (a file, or a folder: out/name), else $OUT/name, else benchmarks/results/name; returns the
    path."""
    if out is None:
        out = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    if os.path.isdir(out) or out.endswith(os.sep):
        out = os.path.join(out, name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
