"""The supported model families and how they differ, one registry entry per HF architecture.

Every family is the same pre-norm decoder (RMSNorm -> attention -> RMSNorm -> MoE or dense SwiGLU)
with rotary embeddings; a family only decides the ModelArch fields below (checked against
transformers 5's `modeling_<family>.py`):

  family     q/k norm                 qkv bias      shared expert         dense layers
  mixtral    none                     no            no                    none
  qwen2_moe  none                     yes (config)  sigmoid-gated         mlp_only_layers / sparse step
  qwen3_moe  per head (over head_dim) attention_bias no                   mlp_only_layers / sparse step
  olmoe      whole projection         attention_bias no                   none; clip_qkv after the norm
  deepseek_v2  MLA (latent KV cache)   attention_bias n_shared_experts x F   first_k_dense_replace; softmax router
  deepseek_v3  MLA (latent KV cache)   attention_bias n_shared_experts x F   first_k_dense_replace; sigmoid router
                                                                            with correction bias, grouped top-k
  gpt_oss    none; attention sinks     attention_bias no                    none; router bias, expert biases,
             sliding / full layers                                        clamped SwiGLU, mxfp4 experts

DeepSeek's routers run in float32 (their weight too), then scale the kept weights by routed_scaling_factor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from moe_infer.experts.activation import ExpertAct
from moe_infer.quant import parse_quant
from moe_infer.models.arch import MLADims, ModelArch, common_fields
from moe_infer.registry import Registry


@dataclass(frozen=True)
class FamilySpec:
    name: str
    parse: Callable[[Any], ModelArch]


MODEL_FAMILIES: Registry[FamilySpec] = Registry("model architecture")
_BY_MODEL_TYPE = {}  # model_type -> FamilySpec, for configs that list no `architectures`


def _family(name: str, *architectures: str):
    def deco(fn: Callable[[Any], dict]) -> Callable[[Any], dict]:
        def parse(cfg: Any) -> ModelArch:
            return ModelArch(family=name, architecture=_architecture(cfg), quant=parse_quant(cfg),
                             **{**common_fields(cfg), **fn(cfg)})

        spec = FamilySpec(name, parse)
        for arch in architectures:
            MODEL_FAMILIES.register(arch)(spec)
        _BY_MODEL_TYPE[name] = spec
        return fn

    return deco


def _architecture(cfg: Any) -> str:
    archs = getattr(cfg, "architectures", None) or []
    return archs[0] if archs else f"<model_type {getattr(cfg, 'model_type', '?')}>"


def _no_sliding(cfg: Any, family: str) -> Tuple[Optional[int], ...]:
    if getattr(cfg, "use_sliding_window", False):
        raise NotImplementedError(f"{family}: use_sliding_window=True is not supported")
    return (None,) * cfg.num_hidden_layers


def _qwen_moe_layers(cfg: Any) -> list:
    """transformers' rule: MoE unless in mlp_only_layers or off the decoder_sparse_step grid."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return [i for i in range(cfg.num_hidden_layers) if i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0]


@_family("mixtral", "MixtralForCausalLM")
def _mixtral(cfg: Any) -> dict:
    window = getattr(cfg, "sliding_window", None)
    return dict(
        num_experts=cfg.num_local_experts, moe_layer_ids=list(range(cfg.num_hidden_layers)),
        moe_intermediate_size=cfg.intermediate_size, intermediate_size=cfg.intermediate_size,
        norm_topk_prob=True, qkv_bias=False, o_bias=False, qk_norm="none", clip_qkv=None,
        shared_expert_intermediate_size=0, shared_expert_gated=False,
        sliding_windows=(window,) * cfg.num_hidden_layers,
    )


@_family("qwen2_moe", "Qwen2MoeForCausalLM")
def _qwen2_moe(cfg: Any) -> dict:
    return dict(
        num_experts=cfg.num_experts, moe_layer_ids=_qwen_moe_layers(cfg),
        moe_intermediate_size=cfg.moe_intermediate_size, intermediate_size=cfg.intermediate_size,
        norm_topk_prob=bool(cfg.norm_topk_prob), qkv_bias=bool(getattr(cfg, "qkv_bias", True)), o_bias=False,
        qk_norm="none", clip_qkv=None,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, shared_expert_gated=True,
        sliding_windows=_no_sliding(cfg, "qwen2_moe"),
    )


@_family("qwen3_moe", "Qwen3MoeForCausalLM")
def _qwen3_moe(cfg: Any) -> dict:
    bias = bool(getattr(cfg, "attention_bias", False))
    return dict(
        num_experts=cfg.num_experts, moe_layer_ids=_qwen_moe_layers(cfg),
        moe_intermediate_size=cfg.moe_intermediate_size, intermediate_size=cfg.intermediate_size,
        norm_topk_prob=bool(cfg.norm_topk_prob), qkv_bias=bias, o_bias=bias, qk_norm="head", clip_qkv=None,
        shared_expert_intermediate_size=0, shared_expert_gated=False,
        sliding_windows=_no_sliding(cfg, "qwen3_moe"),
    )


@_family("olmoe", "OlmoeForCausalLM")
def _olmoe(cfg: Any) -> dict:
    bias = bool(getattr(cfg, "attention_bias", False))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError("olmoe: q_norm spans hidden_size, so head_dim * num_heads must equal hidden_size")
    return dict(
        num_experts=cfg.num_experts, moe_layer_ids=list(range(cfg.num_hidden_layers)),
        moe_intermediate_size=cfg.intermediate_size, intermediate_size=cfg.intermediate_size,
        norm_topk_prob=bool(cfg.norm_topk_prob), qkv_bias=bias, o_bias=bias, qk_norm="proj",
        clip_qkv=getattr(cfg, "clip_qkv", None), shared_expert_intermediate_size=0, shared_expert_gated=False,
        sliding_windows=(None,) * cfg.num_hidden_layers,
    )


def _mla_dims(cfg: Any, interleave: bool) -> MLADims:
    """MLADims of a DeepSeek config; the softmax scale takes YaRN's mscale (mscale_all_dim) squared, as
    DeepSeek's reference code and transformers do."""
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    scale = qk_head_dim ** -0.5
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        if factor > 1:
            mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= mscale * mscale
    return MLADims(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=interleave,
                   softmax_scale=scale)


def _deepseek(cfg: Any, mla: MLADims) -> dict:
    """The fields DeepSeek-V2 and V3 read alike: MLA (one cached latent row a token), the first
    first_k_dense_replace layers dense, n_shared_experts ungated shared experts of the routed experts' width."""
    bias = bool(getattr(cfg, "attention_bias", False))
    first_dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    E = cfg.n_routed_experts
    return dict(
        num_experts=E, moe_layer_ids=[i for i in range(first_dense, cfg.num_hidden_layers)] if E else [],
        moe_intermediate_size=cfg.moe_intermediate_size, intermediate_size=cfg.intermediate_size,
        qkv_bias=bias, o_bias=bias, qk_norm="none", clip_qkv=None,
        shared_expert_intermediate_size=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
        shared_expert_gated=False, shared_expert_name="shared_experts",
        sliding_windows=(None,) * cfg.num_hidden_layers, mla=mla, num_kv_heads=1, head_dim=mla.cache_dim,
        num_expert_group=int(getattr(cfg, "n_group", None) or 1), topk_group=int(getattr(cfg, "topk_group", None) or 1),
        routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0), router_fp32=True,
    )


_LAYER_TYPES = ("sliding_attention", "full_attention")


@_family("gpt_oss", "GptOssForCausalLM")
def _gpt_oss(cfg: Any) -> dict:
    """GPT-OSS: every layer MoE; `layer_types` alternate sliding-window and full attention; attention sinks and
    q/k/v/o biases; a router with a bias (softmax over the top-k logits, the same as softmax then renormalised
    top-k); experts with biases and the clamped SwiGLU; YaRN rotary as configured."""
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != cfg.num_hidden_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"gpt_oss: layer_types must list {cfg.num_hidden_layers} entries of {_LAYER_TYPES}, "
                         f"got {types}")
    window = getattr(cfg, "sliding_window", None)
    if "sliding_attention" in types and not window:
        raise ValueError("gpt_oss: sliding_attention layers need a sliding_window > 0")
    bias = bool(getattr(cfg, "attention_bias", True))
    return dict(
        num_experts=cfg.num_local_experts, moe_layer_ids=list(range(cfg.num_hidden_layers)),
        moe_intermediate_size=cfg.intermediate_size, intermediate_size=cfg.intermediate_size,
        norm_topk_prob=True, qkv_bias=bias, o_bias=bias, qk_norm="none", clip_qkv=None,
        shared_expert_intermediate_size=0, shared_expert_gated=False,
        sliding_windows=tuple(int(window) if t == "sliding_attention" else None for t in types),
        attn_sinks=True, router_bias=True, expert_bias=True, expert_layout="gpt_oss",
        expert_act=ExpertAct("clamped_swiglu", float(getattr(cfg, "swiglu_alpha", 1.702)),
                             float(getattr(cfg, "swiglu_limit", 7.0))),
    )


@_family("deepseek_v2", "DeepseekV2ForCausalLM")
def _deepseek_v2(cfg: Any) -> dict:
    method = getattr(cfg, "topk_method", "greedy") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2: topk_method={method!r} is not supported (greedy, group_limited_greedy)")
    out = _deepseek(cfg, _mla_dims(cfg, interleave=True))  # V2 rotates interleaved pairs (complex form)
    if method == "greedy":
        out.update(num_expert_group=1, topk_group=1)
    return dict(out, scoring="softmax", norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)))


@_family("deepseek_v3", "DeepseekV3ForCausalLM")
def _deepseek_v3(cfg: Any) -> dict:
    method = getattr(cfg, "topk_method", "noaux_tc") or "noaux_tc"
    if method != "noaux_tc":
        raise ValueError(f"deepseek_v3: topk_method={method!r} is not supported (noaux_tc)")
    scoring = getattr(cfg, "scoring_func", "sigmoid") or "sigmoid"
    if scoring != "sigmoid":
        raise ValueError(f"deepseek_v3: scoring_func={scoring!r} is not supported (sigmoid)")
    out = _deepseek(cfg, _mla_dims(cfg, interleave=bool(getattr(cfg, "rope_interleave", True))))
    return dict(out, scoring="sigmoid", has_score_bias=True, norm_topk_prob=bool(cfg.norm_topk_prob))


def family_for(cfg: Any) -> FamilySpec:
    """The FamilySpec of a transformers config, by its `architectures` entry."""
    archs = getattr(cfg, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_FAMILIES:
            return MODEL_FAMILIES.get(arch)
    if not archs and getattr(cfg, "model_type", None) in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[cfg.model_type]
    shown = ", ".join(archs) if archs else f"none listed (model_type {getattr(cfg, 'model_type', '?')!r})"
    raise ValueError(
        f"unsupported model architecture: {shown}; supported: {', '.join(MODEL_FAMILIES.names())}"
    )
