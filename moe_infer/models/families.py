"""The supported model families and how they differ, one registry entry per HF architecture.

Every family is the same pre-norm decoder (RMSNorm -> attention -> RMSNorm -> MoE or dense SwiGLU)
with rotary embeddings; a family only decides the ModelArch fields below (checked against
transformers 5's `modeling_<family>.py`):

  family     q/k norm                 qkv bias      shared expert         dense layers
  mixtral    none                     no            no                    none
  qwen2_moe  none                     yes (config)  sigmoid-gated         mlp_only_layers / sparse step
  qwen3_moe  per head (over head_dim) attention_bias no                   mlp_only_layers / sparse step
  olmoe      whole projection         attention_bias no                   none; clip_qkv after the norm
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from moe_infer.models.arch import ModelArch, common_fields
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
            return ModelArch(family=name, architecture=_architecture(cfg), **common_fields(cfg), **fn(cfg))

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
