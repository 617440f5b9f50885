"""The dense SwiGLU MLP of non-MoE layers (Qwen2/3-MoE `mlp_only_layers`, `decoder_sparse_step`).

Legend: T tokens, D hidden, I dense intermediate. gate and up are one fused [2I, D] projection.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_TI, up_TI = self.gate_up_proj(x_TD).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate_TI) * up_TI)
