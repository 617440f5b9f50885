"""DeepSeek-V3's multi-token-prediction (MTP) layers, loaded and kept for speculative decoding.

A DeepSeek-V3 checkpoint holds `num_nextn_predict_layers` (1) layers after the decoder's last, named as decoder
layers (`model.layers.61.*`): a full decoder block (MLA + MoE, with its own latent KV cache) plus

    enorm, hnorm            RMSNorms of the next token's embedding and of the main model's hidden state
    eh_proj                 [D, 2D]: the two normed vectors, concatenated (embedding first), back to D
    embed_tokens            the layer's own copy of the embedding table
    shared_head.norm, .head the final norm and LM head of the layer's prediction

For the main model's final hidden state h_i at position i (the output of the model's last norm) and the token
t_{i+1} that follows it, the layer predicts t_{i+2}:

    x_i    = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])      (x_i = 0 where i = 0's embedding is masked)
    y_i    = block(x_i, position i)                            (attends to the layer's cache of positions <= i)
    logits = shared_head.head(shared_head.norm(y_i))

which is how vLLM and SGLang run it as a draft model (embedding first in the concatenation; the embedding of
position 0 zeroed). The layers are built only on request (`load_model(..., mtp=True)`, on the last pipeline stage):
a whole MoE layer of memory is not spent otherwise, and a checkpoint's MTP tensors are then known and left unread.
The MoE block of an MTP layer neither counts expert load nor records routing traces (those describe the main model).

Legend: T tokens, D hidden, V vocab.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Sequence, Tuple

import torch
from torch import nn

from moe_infer.layers.moe import MoEBackends
from moe_infer.layers.norm import RMSNorm
from moe_infer.layers.rotary import RotaryEmbedding
from moe_infer.layers.tensor_parallel import ParallelLMHead, VocabParallelEmbedding
from moe_infer.models.arch import ModelArch
from moe_infer.models.decoder import DecoderLayer
from moe_infer.models.shard import ModelShard


class SharedHead(nn.Module):
    """The MTP layer's final norm and LM head (`shared_head.norm`, `shared_head.head`)."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, shard: ModelShard) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, shard.tp)


class MTPLayer(DecoderLayer):
    """One multi-token-prediction layer (module docstring): a decoder block (`forward`, as a decoder layer's) with
    the inputs and head around it (`predict`, `compute_logits`) and one layer's KV cache."""

    def __init__(self, arch: ModelArch, layer_idx: int, rotary: RotaryEmbedding, backends: MoEBackends,
                 dtype: torch.dtype, attn_backend: str, shard: ModelShard) -> None:
        if backends.offload is not None:
            raise ValueError("MTP layers with offloaded experts are not supported: load the model without mtp, or "
                             "keep the experts resident")
        own = dataclasses.replace(backends, stats=None, trace=None)  # the main model's load statistics and traces
        super().__init__(arch, layer_idx, rotary, own, dtype, attn_backend, shard, moe=bool(arch.num_experts))
        D = arch.hidden_size
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, D, dtype, shard.tp)
        self.enorm = RMSNorm(D, arch.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(D, arch.rms_norm_eps, dtype)
        self.eh_proj = nn.Linear(2 * D, D, bias=False, dtype=dtype)  # unquantized in DeepSeek's fp8 checkpoints
        self.shared_head = SharedHead(arch, dtype, shard)
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def predict(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, hidden_TD: torch.Tensor) -> torch.Tensor:
        """input_ids_T (t_{i+1}), positions_T (i) [T], the main model's final hidden states hidden_TD (h_i) [T, D]
        -> the layer's hidden states [T, D], normed by shared_head.norm (compute_logits takes them)."""
        if input_ids_T.dim() != 1 or input_ids_T.shape != positions_T.shape or hidden_TD.shape[0] != len(input_ids_T):
            raise ValueError(f"input_ids {tuple(input_ids_T.shape)}, positions {tuple(positions_T.shape)} and hidden "
                             f"states {tuple(hidden_TD.shape)} must give one token, position and state a row")
        e_TD = self.embed_tokens(input_ids_T).masked_fill((positions_T == 0)[:, None], 0)
        x_TD = self.eh_proj(torch.cat((self.enorm(e_TD), self.hnorm(hidden_TD.to(self.dtype))), dim=-1))
        h_TD, delta_TD = self(x_TD, positions_T)
        return self.shared_head.norm.add_forward(h_TD, delta_TD)[1]

    @torch.no_grad()
    def compute_logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        """predict's hidden states [B, D] -> float32 logits [B, V]."""
        return self.shared_head.head(hidden_BD).float()

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> List[Tuple[Tuple[int, ...], ...]]:
        """The layer's own cache tensors (one entry: the MTP layer is a one-layer model to the cache)."""
        return [self.self_attn.cache_shapes(num_blocks, block_size)]

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device,
                          fill: float = 0.0) -> List[Tuple[torch.Tensor, ...]]:
        return [tuple(torch.full(s, fill, dtype=self.dtype, device=device) for s in shapes)
                for shapes in self.kv_cache_shapes(num_blocks, block_size)]

    def bind_kv_cache(self, kv_caches: Sequence[Tuple[torch.Tensor, ...]]) -> None:
        if len(kv_caches) != 1:
            raise ValueError(f"an MTP layer takes one KV cache entry, got {len(kv_caches)}")
        kv = tuple(kv_caches[0])
        want = self.self_attn.cache_shapes(kv[0].shape[0], kv[0].shape[1]) if kv and kv[0].dim() == 4 else None
        if want is None or tuple(tuple(t.shape) for t in kv) != want or any(t.dtype != self.dtype for t in kv):
            raise ValueError(f"MTP layer KV cache {[(tuple(t.shape), t.dtype) for t in kv]} does not fit "
                             f"{want} in {self.dtype}")
        self.self_attn.kv_cache = kv

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(s) for shapes in self.kv_cache_shapes(1, block_size) for s in shapes) * itemsize


def num_mtp_layers(hf_config) -> int:
    """The MTP layers a checkpoint's config declares (DeepSeek-V3: num_nextn_predict_layers)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def build_mtp_layers(arch: ModelArch, hf_config, rotary: RotaryEmbedding, backends: MoEBackends, dtype: torch.dtype,
                     attn_backend: str, shard: ModelShard) -> nn.ModuleList:
    """The checkpoint's MTP layers (indices num_layers, num_layers + 1, ...), on the last pipeline stage; refused
    with a clear error where the config declares none."""
    n = num_mtp_layers(hf_config)
    if n == 0:
        raise ValueError("mtp=True but the checkpoint's config declares no multi-token-prediction layers "
                         "(num_nextn_predict_layers is 0 or missing)")
    if arch.mla is None:
        raise ValueError("MTP layers are built for DeepSeek-V3-style (MLA) checkpoints only")
    if not shard.is_last_stage:
        return nn.ModuleList()
    return nn.ModuleList(MTPLayer(arch, arch.num_layers + j, rotary, backends, dtype, attn_backend, shard)
                         for j in range(n))
