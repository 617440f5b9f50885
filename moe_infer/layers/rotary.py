"""Rotary position embedding (rotate-half / NeoX layout) from the config's `rope_parameters`.

inv_freq and the attention scaling come from `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`
(linear, yarn, llama3, ...); only the "default" type, which transformers computes inside each model
class, is done here. Types whose frequencies change with the running sequence length (dynamic,
longrope) are refused: a paged batch mixes sequence lengths.

Legend: T tokens, H heads, d head_dim.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import nn

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
    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions_T: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d] in dtype, computed in float32 as transformers does."""
        freqs_Th = positions_T[:, None].float() * self.inv_freq.to(positions_T.device)[None, :]
        emb_Td = torch.cat((freqs_Th, freqs_Th), dim=-1)
        return (emb_Td.cos() * self.attention_scaling).to(dtype), (emb_Td.sin() * self.attention_scaling).to(dtype)

    def forward(
        self, positions_T: torch.Tensor, q_THd: torch.Tensor, k_THd: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        cos_Td, sin_Td = self.cos_sin(positions_T, q_THd.dtype)
        cos_T1d, sin_T1d = cos_Td[:, None, :], sin_Td[:, None, :]
        q_THd = q_THd * cos_T1d + _rotate_half(q_THd) * sin_T1d
        k_THd = k_THd * cos_T1d + _rotate_half(k_THd) * sin_T1d
        return q_THd, k_THd
