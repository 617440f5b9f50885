"""What a model's router computes, independent of the backend that computes it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingSpec:
    num_experts: int  # E (global)
    top_k: int  # K
    scoring: str = "softmax"  # softmax (Mixtral, Qwen, OLMoE) | sigmoid (DeepSeek-V3)
    renormalize: bool = True  # divide the K kept weights by their sum
    num_expert_group: int = 1  # DeepSeek-V3 grouped top-k: n_group
    topk_group: int = 1  # groups kept per token
    routed_scaling_factor: float = 1.0  # multiplies the final weights
    has_score_bias: bool = False  # sigmoid + e_score_correction_bias (selection only)

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring must be softmax or sigmoid, got {self.scoring!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts % self.num_expert_group:
            raise ValueError(f"num_experts={self.num_experts} not divisible by n_group={self.num_expert_group}")
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.num_expert_group}]")
