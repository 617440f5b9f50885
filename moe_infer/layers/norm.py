"""RMSNorm with transformers' rounding: normalise in float32, cast back, then scale by the weight.

On CUDA a registered kernel (RMS_NORM_KERNELS["triton"], `moe_infer.layers.norm_triton`, a plugin)
does the norm, and the residual add before it (`RMSNorm.add_forward`), in one launch instead of
seven or eight; everywhere else the torch path below runs (the reference the kernel is tested on).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from moe_infer.layers.tensor_parallel import ShardGroup
from moe_infer.registry import Registry


class NormKernel(NamedTuple):
    norm: object  # (x, weight, eps) -> y
    add_norm: object  # (h, delta, weight, eps) -> (h + delta, y)


RMS_NORM_KERNELS: Registry[NormKernel] = Registry("rms norm kernel")


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _kernel(x: torch.Tensor) -> Optional[NormKernel]:
    return RMS_NORM_KERNELS.get("triton") if x.is_cuda and "triton" in RMS_NORM_KERNELS else None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., size] -> [..., size] in x's dtype."""
        kernel = _kernel(x)
        if kernel is not None and x.dim() in (2, 3) and x.stride(-1) == 1:
            return kernel.norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, self(h + delta)): the residual add and the norm after it."""
        kernel = _kernel(h)
        if kernel is not None and h.dim() == 2 and h.stride(-1) == 1 and delta.stride(-1) == 1:
            return kernel.add_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, rms_norm_torch(h, self.weight, self.eps)


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
