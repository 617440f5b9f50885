"""The benchmarks' shared helpers: the Qwen3-MoE shapes (REAL: Qwen3-30B-A3B's layers, TINY: a CPU smoke size), the
random-weight checkpoint they are built from (transformers' model, the baseline), timers (`clock`, `clock_in_graph`,
`time_ours` / `time_hf`: one greedy generate call, EOS ignored), the device label and `write_result`.

Its own end-to-end run (ours against transformers' `generate` at batch 1 / 16 / 64) is engine_roofline.py's decode
rows now: the same checkpoint and prompts, tok/s of both and the share of equal greedy tokens
(`--compare enforce_eager=true` adds the eager engine).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
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


def qwen3_config(dims: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**dims, eos_token_id=0, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)


def write_config(dims: dict, folder: str) -> str:
    """config.json only, of the model build_checkpoint writes (the engine makes the weights: load_format=dummy)."""
    qwen3_config(dims).save_pretrained(folder)
    return folder


def build_checkpoint(dims: dict, dtype: torch.dtype, device: torch.device, out_dir: str):
    """Random-weight Qwen3-MoE saved as an HF folder; returns transformers' model (the baseline)."""
    from transformers import Qwen3MoeForCausalLM

    config = qwen3_config(dims)
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

