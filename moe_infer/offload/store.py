"""The resident expert store: stacked expert weights held on the compute device."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from moe_infer.registry import Registry

EXPERT_STORES: Registry[type] = Registry("expert store")


@EXPERT_STORES.register("resident")
class ResidentExpertStore(nn.Module):
    """Legend: E local experts, F expert intermediate, D hidden."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        E, D, F = num_local_experts, hidden_size, intermediate_size
        self.w13_E2FD = nn.Parameter(torch.empty(E, 2 * F, D, dtype=dtype), requires_grad=False)
        self.w2_EDF = nn.Parameter(torch.empty(E, D, F, dtype=dtype), requires_grad=False)

    def weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.w13_E2FD, self.w2_EDF
