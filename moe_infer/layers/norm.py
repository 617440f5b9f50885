"""RMSNorm with transformers' rounding: normalise in float32, cast back, then scale by the weight."""
from __future__ import annotations

import torch
from torch import nn

from moe_infer.layers.tensor_parallel import ShardGroup


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., size] -> [..., size] in x's dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector split across a tensor-parallel axis (OLMoE's q/k norm under tp > 1): the
    squares are summed over the ranks; `replicas` ranks hold each element (replicated KV heads)."""

    def __init__(self, local_size: int, full_size: int, eps: float, dtype: torch.dtype, shard: ShardGroup,
                 replicas: int = 1) -> None:
        super().__init__()
        self.eps, self.full_size, self.shard, self.replicas = eps, full_size, shard, replicas
        self.weight = nn.Parameter(torch.ones(local_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        sum_sq = self.shard.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        if self.replicas > 1:
            sum_sq = sum_sq / self.replicas
        x32 = x32 * torch.rsqrt(sum_sq / self.full_size + self.eps)
        return self.weight * x32.to(x.dtype)
