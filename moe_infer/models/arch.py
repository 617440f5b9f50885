"""ModelArch: everything the decoder needs to know about a checkpoint, parsed from its HF config.

The family registry (`families.py`) says how each supported `architectures` entry differs (q/k norm
kind, qkv bias, shared expert, dense layers, ...); this file holds the resulting plain dataclass and
`load_arch(path)` reads a checkpoint folder into it (hf_config.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from moe_infer.experts.activation import SILU, ExpertAct


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention (DeepSeek-V2/V3): the widths of its projections and of its cache row."""

    q_lora_rank: Optional[int]  # None: a plain q_proj
    kv_lora_rank: int  # the latent c_kv a token caches (512)
    qk_nope_head_dim: int  # per head: query/key part without position (128)
    qk_rope_head_dim: int  # per head: the rotary part; its key is shared by all heads and cached (64)
    v_head_dim: int  # per head value width (128)
    rope_interleave: bool  # the checkpoint's rotary pairs are interleaved (x0, x1), (x2, x3), ...
    softmax_scale: float  # qk_head_dim^-0.5, times the YaRN mscale squared where the config asks

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values a token caches per layer: the latent and the rotary key (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelArch:
    family: str  # mixtral | qwen2_moe | qwen3_moe | olmoe | deepseek_v2 | deepseek_v3 | gpt_oss
    architecture: str  # the HF `architectures[0]`, e.g. "Qwen3MoeForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # MLA: 1 (the latent row is one "head" every query head reads)
    head_dim: int  # MLA: the cache row's width (kv_lora_rank + qk_rope_head_dim)
    max_position_embeddings: int
    eos_token_ids: List[int]
    num_experts: int
    top_k: int
    moe_layer_ids: List[int]  # layers with a MoE block; the others are dense SwiGLU MLPs
    tie_word_embeddings: bool
    moe_intermediate_size: int  # F of each routed expert
    intermediate_size: int  # the dense MLP of non-MoE layers
    rms_norm_eps: float
    norm_topk_prob: bool  # renormalise the K kept router weights
    qkv_bias: bool
    o_bias: bool
    qk_norm: str  # none | head (Qwen3: RMSNorm over head_dim) | proj (OLMoE: over the whole projection)
    clip_qkv: Optional[float]  # OLMoE: clamp q, k, v to [-clip, clip] after the norm
    shared_expert_intermediate_size: int  # 0: no shared expert
    shared_expert_gated: bool  # Qwen2-MoE: shared output scaled by sigmoid(gate(x))
    sliding_windows: Tuple[Optional[int], ...]  # per layer: None = full causal attention
    hidden_act: str = "silu"
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    rope_parameters: dict = field(default_factory=dict)
    mla: Optional[MLADims] = None  # multi-head latent attention in place of per-head K/V
    scoring: str = "softmax"  # router scores: softmax | sigmoid (DeepSeek-V3)
    num_expert_group: int = 1  # grouped top-k (DeepSeek): n_group, topk_group
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    has_score_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (selection only)
    router_fp32: bool = False  # the router's weight and logits in float32 (DeepSeek)
    shared_expert_name: str = "shared_expert"  # checkpoint name of the shared expert (DeepSeek: shared_experts)
    quant: Optional[Any] = None  # QuantSpec (moe_infer/quant.py): the checkpoint's weights quantized
    attn_sinks: bool = False  # GPT-OSS: a learned logit per query head in each softmax's denominator
    router_bias: bool = False  # GPT-OSS: the router has a bias
    expert_bias: bool = False  # GPT-OSS: gate/up and down biases per expert
    expert_act: ExpertAct = SILU  # the experts' gated activation (GPT-OSS: clamped SwiGLU)
    # how the checkpoint stores fused experts: "stacked" gate_up_proj [E, 2F, D] (gate; up); "gpt_oss"
    # gate_up_proj [E, D, 2F] with gate and up in alternate columns, down_proj [E, F, D] (mxfp4: *_blocks, *_scales)
    expert_layout: str = "stacked"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not divisible by num_kv_heads={self.num_kv_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"only SwiGLU (hidden_act='silu') experts are supported, got {self.hidden_act!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.expert_layout not in ("stacked", "gpt_oss"):
            raise ValueError(f"expert_layout must be stacked or gpt_oss, got {self.expert_layout!r}")
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")
        bad = [i for i in self.moe_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"moe_layer_ids {bad} outside [0, {self.num_layers})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dimensions the rotary embedding turns: the head (MLA: its rotary part)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.moe_layer_ids


def _eos_ids(value: Any) -> List[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def merge_eos(arch_eos: List[int], extra: Any) -> List[int]:
    """The config's eos ids, then any more from generation_config.json (e.g. Qwen's <|im_end|>)."""
    out = list(arch_eos)
    out += [e for e in _eos_ids(extra) if e not in out]
    return out


def common_fields(cfg: Any) -> dict:
    """Fields read the same way in every supported family."""
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    eos = _eos_ids(getattr(cfg, "eos_token_id", None))
    rope = getattr(cfg, "rope_parameters", None)
    if rope is None:  # older configs: rope_theta + rope_scaling
        rope = dict(getattr(cfg, "rope_scaling", None) or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_ids=eos,
        top_k=cfg.num_experts_per_tok,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.rms_norm_eps),
        hidden_act=getattr(cfg, "hidden_act", "silu"),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        pad_token_id=getattr(cfg, "pad_token_id", None),
        rope_parameters=dict(rope),
    )
