"""The dense SwiGLU MLP of non-MoE layers (Qwen2/3-MoE `mlp_only_layers`, `decoder_sparse_step`).

Tensor parallel over `tp`: gate and up column-parallel (each rank its I / tp rows of both, fused as
[gate; up]), down row-parallel (one all-reduce).

Legend: T tokens, D hidden, I dense intermediate (the rank's share). gate and up are one fused [2I, D] projection.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from typing import Optional

from moe_infer.layers.linear import linear
from moe_infer.quant import QuantSpec, make_linear
from moe_infer.layers.tensor_parallel import SINGLE, RowParallelLinear, ShardGroup


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, tp: ShardGroup = SINGLE,
                 quant: Optional[QuantSpec] = None) -> None:
        super().__init__()
        local = tp.split(intermediate_size, "intermediate_size")
        self.gate_up_proj = make_linear(hidden_size, 2 * local, False, dtype, quant)
        self.down_proj = RowParallelLinear(local, hidden_size, False, dtype, tp, quant)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_TI, up_TI = linear(x_TD, self.gate_up_proj.weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate_TI) * up_TI)
