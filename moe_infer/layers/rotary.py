"""Rotary position embedding (rotate-half / NeoX layout) from the config's `rope_parameters`.

inv_freq and the attention scaling come from `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`
(linear, yarn, llama3, ...); only the "default" type, which transformers computes inside each model
class, is done here. Types whose frequencies change with the running sequence length (dynamic,
longrope) are refused: a paged batch mixes sequence lengths.

`cos_sin_cache` builds, once per (device, dtype), the table that the fused rotary + K/V-write kernel
(`moe_infer.kernels.rope_kv`) reads instead of computing cos/sin every layer of every step: row p holds
[cos_p[:d/2] | sin_p[:d/2]] (the halves of emb = [freqs | freqs] repeat) from `cos_sin` itself, so the
values are those of the unfused path bit for bit. It covers positions [0, max_position_embeddings); the
model runner refuses a max_model_len beyond that. `rope_store_kv_ref` is the kernel's PyTorch reference
(with the q/k norm the kernel can apply first, by `rms_norm_torch`).

Legend: T tokens, H heads, Hkv KV heads, d head_dim, P table positions, Nb cache blocks, S block size.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from moe_infer.layers.norm import rms_norm_torch
from moe_infer.layers.paged_attention import store_kv

_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_inv_freq(config: Any, head_dim: int) -> Tuple[torch.Tensor, float]:
    """(inv_freq [d/2] float32, attention_scaling) of a transformers config."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in _LENGTH_DEPENDENT:
        raise NotImplementedError(f"rope_type {rope_type!r} depends on the sequence length; not supported")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unknown rope_type {rope_type!r}; transformers knows {sorted(ROPE_INIT_FUNCTIONS)}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if 2 * inv_freq.numel() != head_dim:
        raise NotImplementedError(f"partial rotary embeddings ({2 * inv_freq.numel()} of head_dim {head_dim})")
    return inv_freq.float(), float(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: Any, head_dim: int, max_positions: Optional[int] = None) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.head_dim = head_dim
        self.max_positions = int(max_positions or config.max_position_embeddings)  # cos_sin_cache's rows
        if self.max_positions <= 0:
            raise ValueError(f"max_position_embeddings must be positive, got {self.max_positions}")
        self._tables: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def cos_sin(self, positions_T: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d] in dtype, computed in float32 as transformers does."""
        freqs_Th = positions_T[:, None].float() * self.inv_freq.to(positions_T.device)[None, :]
        emb_Td = torch.cat((freqs_Th, freqs_Th), dim=-1)
        return (emb_Td.cos() * self.attention_scaling).to(dtype), (emb_Td.sin() * self.attention_scaling).to(dtype)

    def cos_sin_cache(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[P, d] in dtype: row p = [cos_p[:d/2] | sin_p[:d/2]] of `cos_sin`, built on first use per (device, dtype)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" are one table (the warm-up builds it
            dev = torch.device("cuda", torch.cuda.current_device())  # with the runner's device, a step with q's)
        key = (dev, dtype)
        table_Pd = self._tables.get(key)
        if table_Pd is None:
            if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a table built inside a capture would only be computed when the graph replays
                raise RuntimeError("the rotary cos/sin table must be built by an eager step before CUDA-graph capture")
            cos_Pd, sin_Pd = self.cos_sin(torch.arange(self.max_positions, device=key[0]), dtype)
            half = self.head_dim // 2
            table_Pd = torch.cat((cos_Pd[:, :half], sin_Pd[:, :half]), dim=1).contiguous()
            self._tables[key] = table_Pd
        return table_Pd

    def forward(
        self, positions_T: torch.Tensor, q_THd: torch.Tensor, k_THd: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        cos_Td, sin_Td = self.cos_sin(positions_T, q_THd.dtype)
        cos_T1d, sin_T1d = cos_Td[:, None, :], sin_Td[:, None, :]
        q_THd = q_THd * cos_T1d + _rotate_half(q_THd) * sin_T1d
        k_THd = k_THd * cos_T1d + _rotate_half(k_THd) * sin_T1d
        return q_THd, k_THd


def rope_store_kv_ref(
    q_THd: torch.Tensor, k_THd: torch.Tensor, v_THd: torch.Tensor, positions_T: torch.Tensor,
    cos_sin_Pd: torch.Tensor, k_cache_NbSHd: torch.Tensor, v_cache_NbSHd: torch.Tensor, slot_mapping_T: torch.Tensor,
    *, q_norm_weight: Optional[torch.Tensor] = None, k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 0.0, norm_mode: str = "none",
) -> torch.Tensor:
    """PyTorch reference of `moe_infer.kernels.rope_kv.rope_store_kv`: RMSNorm q and k (norm_mode "head": per
    head over d; "proj": over the whole [H * d] / [Hkv * d] projection; "none"), rotate them with the
    table's rows, store k and v at the slots (negative slots skipped) -> rotated q."""
    if norm_mode in ("head", "proj"):
        q_THd = _qk_norm(q_THd, q_norm_weight, norm_eps, norm_mode)
        k_THd = _qk_norm(k_THd, k_norm_weight, norm_eps, norm_mode)
    elif norm_mode != "none":
        raise ValueError(f"norm_mode must be none, head or proj, got {norm_mode!r}")
    half = cos_sin_Pd.shape[1] // 2
    rows_Td = cos_sin_Pd[positions_T.long()]
    cos_T1d = rows_Td[:, :half].repeat(1, 2)[:, None, :]
    sin_T1d = rows_Td[:, half:].repeat(1, 2)[:, None, :]
    q_THd = q_THd * cos_T1d + _rotate_half(q_THd) * sin_T1d
    store_kv(k_THd * cos_T1d + _rotate_half(k_THd) * sin_T1d, v_THd, k_cache_NbSHd, v_cache_NbSHd, slot_mapping_T)
    return q_THd


def _qk_norm(x_THd: torch.Tensor, weight: Optional[torch.Tensor], eps: float, mode: str) -> torch.Tensor:
    if weight is None:
        raise ValueError(f"norm_mode {mode!r} needs the q and k norm weights")
    if mode == "head":
        return rms_norm_torch(x_THd, weight, eps)
    T, H, d = x_THd.shape
    return rms_norm_torch(x_THd.reshape(T, H * d), weight, eps).view(T, H, d)
