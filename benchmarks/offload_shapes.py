"""benchmarks/offload.py's shapes and sizes (the Mixtral and Qwen3 configs, expert and other bytes, the host
layers that fit, the checkpoint formats of --quantization) and its timed decode of several streams."""
from __future__ import annotations

import random
import time

import torch
from e2e_generate import sync

from moe_infer import LLM, SamplingParams

GiB = 1 << 30


def shapes(smoke: bool) -> dict:
    from transformers import MixtralConfig, Qwen3MoeConfig

    if smoke:
        mix = MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
        qwen = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
                              num_experts_per_tok=4, vocab_size=128, max_position_embeddings=256, norm_topk_prob=True)
    else:
        mix = MixtralConfig()  # Mixtral-8x7B: 32 layers, D=4096, F=14336, E=8, K=2
        qwen = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_hidden_layers=48,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                              num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    mix.architectures, qwen.architectures = ["MixtralForCausalLM"], ["Qwen3MoeForCausalLM"]
    return {"mixtral": mix, "qwen3": qwen}


# --quantization: the checkpoint format the dummy weights are stored in (every linear weight of the decoder layers
# but the routers, as the format's real releases). Each format the engine reads gets its quantization_config here.
QUANT_CONFIGS = {
    "none": None,
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*mlp.gate$"],
             "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                 "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}},
    "mxfp4": {"quant_method": "mxfp4"},
}
SMOKE_BLOCK = 32  # the smoke shapes' blocks / groups (128 does not divide their widths)
ATTN_BYTES = {None: 2, "fp8": 1, "int4": 0.5, "mxfp4": 2}  # a dense weight's bytes per value (mxfp4: experts only)


def quant_spec(cfg):
    """The engine's QuantSpec of cfg's quantization_config (None: bf16)."""
    from moe_infer.quant import parse_quant

    return parse_quant(cfg)


def expert_bytes(cfg) -> int:
    """One expert's bytes in the checkpoint's format (quantized: data and scales), as the offload tiers hold and
    move it (moe_infer/offload/layout.py): the unit of the bound."""
    from moe_infer.offload.layout import ExpertLayout

    F = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    return ExpertLayout(cfg.hidden_size, F, torch.bfloat16, quant_spec(cfg)).nbytes


def num_experts(cfg) -> int:
    return getattr(cfg, "num_local_experts", None) or cfg.num_experts


def non_expert_bytes(cfg) -> int:
    """Bytes of attention (bf16, or 1 a weight quantized: the scales are under 0.01 %), routers, embedding and head
    (bf16): what the GPU holds besides the experts."""
    D, H = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q = quant_spec(cfg)
    attn = D * H * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * ATTN_BYTES[q and q.method]
    return cfg.num_hidden_layers * (attn + 2 * D * num_experts(cfg)) + 2 * 2 * cfg.vocab_size * D


def host_layers(cfg, reserve_gb: float) -> int:
    """MoE layers whose experts fit in MemAvailable minus a reserve (the baseline, the OS, the rest)."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return int((avail - reserve_gb * GiB) // (num_experts(cfg) * expert_bytes(cfg)))


def run_streams(llm: LLM, streams: int, new_tokens: int, vocab: int) -> dict:
    """Decode `streams` sequences together; timed from the third decode step (prefill and warm-up apart)."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rng = random.Random(streams)
    for _ in range(streams):
        eng.add_request({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(16)]}, params)
    warm = 0
    while eng.has_unfinished_requests():
        eng.step()
        if all(len(s.output_token_ids) >= 1 for r in eng.requests.values() for s in r.seqs):
            warm += 1
            if warm == 2:
                break
    llm.engine.runner.offload.reset_stats()
    sync(eng.device)
    t0, steps = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    sync(eng.device)
    elapsed = time.perf_counter() - t0
    stats = llm.get_offload_stats()["total"]
    return {"streams": streams, "decode_steps": steps, "seconds": elapsed, "step_ms": 1e3 * elapsed / max(steps, 1),
            "tok_s": streams * steps / elapsed, **{k: stats[k] for k in (
                "hit_rate", "prefetch_token_recall", "prefetch_recall", "cpu_share", "stream_share", "gb_h2d",
                "needed", "copied", "streamed", "cpu", "shared", "shared_share", "partial", "partial_share",
                "partial_missing", "cpu_shared", "prefetched", "prefetch_wasted", "prefetch_declined",
                "prefetch_evicted_needed", "gb_prefetch_wasted")}}
