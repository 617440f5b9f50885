"""The generic MoE decoder: embeddings -> N x (RMSNorm, attention, RMSNorm, MoE or dense MLP) -> norm.

One class serves every family of `families.py`; the ModelArch switches the differences on. The
forward takes a step's flattened tokens and reads the paged-attention metadata from the forward
context, so it knows nothing of sequences or scheduling.

Legend: T tokens, D hidden, V vocab, B rows to compute logits for.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from moe_infer.layers.attention import Attention
from moe_infer.layers.mlp import DenseMLP
from moe_infer.layers.moe import MoEBackends, MoELayer
from moe_infer.layers.norm import RMSNorm
from moe_infer.layers.rotary import RotaryEmbedding
from moe_infer.models.arch import ModelArch
from moe_infer.routing.spec import RoutingSpec


class DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, layer_idx: int, rotary: RotaryEmbedding, backends: MoEBackends, dtype: torch.dtype,
        attn_backend: str = "torch",
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, layer_idx, rotary, dtype, attn_backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.is_moe = arch.is_moe_layer(layer_idx)
        if self.is_moe:
            spec = RoutingSpec(num_experts=arch.num_experts, top_k=arch.top_k, renormalize=arch.norm_topk_prob)
            self.mlp: nn.Module = MoELayer(
                layer_idx, arch.hidden_size, arch.moe_intermediate_size, spec, backends, dtype,
                shared_intermediate_size=arch.shared_expert_intermediate_size,
                shared_gated=arch.shared_expert_gated,
            )
        else:
            self.mlp = DenseMLP(arch.hidden_size, arch.intermediate_size, dtype)

    def forward(self, h_TD: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        h_TD = h_TD + self.self_attn(self.input_layernorm(h_TD), positions_T)
        return h_TD + self.mlp(self.post_attention_layernorm(h_TD))


class MoEModel(nn.Module):
    """A causal MoE LM over a paged KV cache. Build through `moe_infer.models.load_model`."""

    def __init__(
        self, arch: ModelArch, hf_config: Any, dtype: torch.dtype, backends: Optional[MoEBackends] = None,
        attn_backend: str = "torch",
    ) -> None:
        super().__init__()
        self.arch, self.hf_config, self.dtype = arch, hf_config, dtype
        self.backends = backends or MoEBackends()
        self.rotary = RotaryEmbedding(hf_config, arch.head_dim)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, self.rotary, self.backends, dtype, attn_backend) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """input_ids_T, positions_T [T] (int) -> final-norm hidden states [T, D] in the model dtype."""
        if input_ids_T.dim() != 1 or input_ids_T.shape != positions_T.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids_T.shape)} and positions {tuple(positions_T.shape)} must be equal 1-D"
            )
        h_TD = self.embed_tokens(input_ids_T)
        for layer in self.layers:
            h_TD = layer(h_TD, positions_T)
        return self.norm(h_TD)

    @torch.no_grad()
    def compute_logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        """hidden [B, D] -> float32 logits [B, V]."""
        return self.lm_head(hidden_BD).float()

    def bind_kv_cache(self, kv_caches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One (k_cache, v_cache) per layer, each [num_blocks, block_size, Hkv, d] in the model dtype."""
        if len(kv_caches) != self.arch.num_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {self.arch.num_layers} layers")
        want = (self.arch.num_kv_heads, self.arch.head_dim)
        for i, (k, v) in enumerate(kv_caches):
            if k.dim() != 4 or tuple(k.shape[2:]) != want or k.shape != v.shape:
                raise ValueError(
                    f"layer {i}: k {tuple(k.shape)} / v {tuple(v.shape)} must both be "
                    f"[num_blocks, block_size, {want[0]}, {want[1]}]"
                )
            if k.dtype != self.dtype or v.dtype != self.dtype:
                raise ValueError(f"layer {i}: KV cache dtype {k.dtype}/{v.dtype}, model dtype {self.dtype}")
        for layer, kv in zip(self.layers, kv_caches):
            layer.self_attn.kv_cache = (kv[0], kv[1])

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of K and V of all layers for one block of block_size tokens."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.arch.num_layers * block_size * self.arch.num_kv_heads * self.arch.head_dim * itemsize

    def moe_layers(self) -> List[MoELayer]:
        return [layer.mlp for layer in self.layers if layer.is_moe]
