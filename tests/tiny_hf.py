"""Tiny random transformers MoE checkpoints (the oracle side of the model tests).

`make_tiny_checkpoint(family, out_dir)` builds a 2-3 layer model of one family with that family's
specials switched on, saves it with `save_pretrained` (safetensors) and can rewrite the expert
tensors in either naming and/or shard the file; `load_hf_model(path)` loads transformers' own model
from it, the reference our decoder is checked against.

Expert namings (transformers 5 writes the per-expert one, converting from its fused parameters):
  per-expert  `...mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` (Mixtral: `block_sparse_moe.
              experts.{e}.w1/w3/w2.weight`)
  fused       `...mlp.experts.gate_up_proj` [E, 2F, D] (gate; up) and `...mlp.experts.down_proj` [E, D, F]
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Tuple

import torch
from safetensors.torch import load_file, save_file

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")

_COMMON = dict(
    vocab_size=160, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, rms_norm_eps=1e-6, num_experts_per_tok=2, tie_word_embeddings=False,
    eos_token_id=2, bos_token_id=1, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

_FAMILY_KWARGS: Dict[str, dict] = {
    "mixtral": dict(intermediate_size=48, num_local_experts=6),
    "qwen2_moe": dict(  # shared expert + sigmoid gate, a dense layer, qkv bias
        intermediate_size=80, moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=8,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, qkv_bias=True,
    ),
    "qwen3_moe": dict(  # per-head q/k norm, head_dim != hidden / heads, renormalised top-k
        intermediate_size=80, moe_intermediate_size=32, num_experts=8, head_dim=24, norm_topk_prob=True,
    ),
    "olmoe": dict(  # whole-projection q/k norm, clip_qkv
        intermediate_size=32, num_experts=8, clip_qkv=2.5, norm_topk_prob=False,
    ),
    # MLA: a latent of 32 + a rotary key of 8 cached; heads of 16 + 8 (q, k) and 12 (v); the first layer dense;
    # shared experts; V2: plain q_proj, softmax router with group-limited top-k; V3: q-LoRA, sigmoid router with
    # the correction bias (randomised below), grouped top-k, renormalised and scaled weights
    "deepseek_v2": dict(
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=2,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False,
        routed_scaling_factor=1.5,
    ),
    "deepseek_v3": dict(
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    ),
    # GPT-OSS: sliding-window (5) and full layers alternating, attention sinks, q/k/v/o biases, router and expert
    # biases; a SwiGLU clamp of 2.0 (7.0 in the release) so that the clamp acts on these random weights, where the
    # installed transformers reads it from the config (`_gpt_oss_limit`); YaRN as the release configures it (its
    # factor and original length scaled down)
    "gpt_oss": dict(
        intermediate_size=32, num_local_experts=6, head_dim=16, sliding_window=5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
    ),
}


def _gpt_oss_limit() -> float:
    """The SwiGLU clamp of the tiny GPT-OSS configs: 2.0 (it acts on random weights) where transformers' model reads
    `swiglu_limit` from the config (5.24 does), else the 7.0 that older releases hard-code (5.17, the GPU machines'
    version, ignores the field: the oracle would clamp at 7.0 while the engine follows the config)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    probe = GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=2, swiglu_limit=2.0)
    return 2.0 if GptOssExperts(probe).limit == 2.0 else 7.0


def _hf_classes(family: str):
    import transformers

    names = {
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
        "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    }
    if family not in names:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    cfg_name, model_name = names[family]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are not flat; norms away from 1 so a skipped norm shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:  # GPT-OSS stores its experts [E, in, out]
                fan_in = p.shape[-2] if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and \
                    "GptOss" in type(model).__name__ else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in**0.5))
        for name, b in model.named_buffers():  # DeepSeek-V3: a bias that changes which experts are chosen
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


_PER_EXPERT_RE = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$")
_MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
_QWEN_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _to_fused(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    out, groups = {}, {}
    for k, v in sd.items():
        m = _PER_EXPERT_RE.match(k)
        if m is None:
            out[k] = v
            continue
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        groups.setdefault(prefix, {})[(e, proj)] = v
    for prefix, g in groups.items():
        E = 1 + max(e for e, _ in g)
        names = _MIXTRAL_NAMES if (0, "w1") in g else _QWEN_NAMES
        gate_up = [torch.cat([g[(e, names["gate"])], g[(e, names["up"])]], 0) for e in range(E)]
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
        out[f"{prefix}.experts.down_proj"] = torch.stack([g[(e, names["down"])] for e in range(E)]).contiguous()
    return {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in out.items()}  # transformers 5 names


def _to_per_expert(sd: Dict[str, torch.Tensor], family: str) -> Dict[str, torch.Tensor]:
    out = {}
    names = _MIXTRAL_NAMES if family == "mixtral" else _QWEN_NAMES
    for k, v in sd.items():
        if k.endswith(".experts.gate_up_proj"):
            prefix = k[: -len(".experts.gate_up_proj")]
            F = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}.experts.{e}.{names['gate']}.weight"] = v[e, :F].contiguous()
                out[f"{prefix}.experts.{e}.{names['up']}.weight"] = v[e, F:].contiguous()
        elif k.endswith(".experts.down_proj"):
            prefix = k[: -len(".experts.down_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}.experts.{e}.{names['down']}.weight"] = v[e].contiguous()
        else:
            out[k] = v
    if family == "mixtral":  # the original Mixtral checkpoint names
        out = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in out.items()}
    return out


def _write_state(out_dir: str, sd: Dict[str, torch.Tensor], sharded: bool) -> None:
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(out_dir, f))
    meta = {"format": "pt"}
    if not sharded:
        save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return
    keys = sorted(sd)
    num_shards = 3
    weight_map, total = {}, 0
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[i::num_shards]}
        save_file(part, os.path.join(out_dir, fname), metadata=meta)
        weight_map.update({k: fname for k in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def read_state_dict(path: str) -> Dict[str, torch.Tensor]:
    """All tensors of a (single-file or sharded) safetensors checkpoint folder."""
    sd = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(path, f)))
    return sd


def make_tiny_checkpoint(
    family: str, out_dir, *, dtype: torch.dtype = torch.float32, seed: int = 0,
    per_expert_names: bool = False, sharded: bool = False, **overrides,
) -> str:
    """Build, randomise and save a tiny `family` model to out_dir; returns out_dir as a str.

    per_expert_names: True writes `experts.{e}.<proj>.weight` tensors, False the fused
    `experts.gate_up_proj` / `experts.down_proj` (whichever transformers did not write is rewritten).
    sharded: split the tensors over 3 files with a `model.safetensors.index.json`.
    overrides: any config field (e.g. tie_word_embeddings=True, num_hidden_layers=2).
    """
    cfg_cls, model_cls = _hf_classes(family)
    kwargs = {**_COMMON, **_FAMILY_KWARGS[family], **overrides}
    if family == "gpt_oss" and "swiglu_limit" not in overrides:
        kwargs["swiglu_limit"] = _gpt_oss_limit()
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(dtype)
    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    sd = read_state_dict(out_dir)
    if per_expert_names and family == "gpt_oss":
        raise ValueError("GPT-OSS checkpoints have no per-expert naming")
    sd = _to_per_expert(sd, family) if per_expert_names else _to_fused(sd)
    _write_state(out_dir, sd, sharded)
    return out_dir


def load_hf_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' own model (eager attention, eval) from a checkpoint folder: the oracle."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="eager")
    return model.eval()


def hf_model_class(family: str) -> Tuple[type, type]:
    """(config class, causal-LM class) of a family."""
    return _hf_classes(family)


def edit_config(path, **fields) -> None:
    """Set fields of a checkpoint folder's config.json (tests of configurations transformers would not write)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
