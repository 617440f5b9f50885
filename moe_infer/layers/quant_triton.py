"""FP8_LINEAR_KERNELS["triton"]: the W8A8 block-scaled GEMM (`moe_infer.kernels.fp8_gemm`: activations quantized per
token and 128-wide group, fp8 tensor-core dots, the block scales applied per K-block) for fp8 weights on a CUDA
device of compute capability 8.9 or more (Ada, Hopper); elsewhere it declines and `linear_fp8` dequantizes. A plugin
module (`moe_infer.plugins`): it imports triton, so it registers only where triton is installed."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from moe_infer.kernels.fp8_gemm import w8a8_block_gemm
from moe_infer.quant import FP8_LINEAR_KERNELS


@functools.lru_cache(maxsize=None)
def has_fp8_dot(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_linear_triton(x: torch.Tensor, w_NK: torch.Tensor, scale_inv: torch.Tensor, block_n: int,
                      block_k: int) -> Optional[torch.Tensor]:
    """y = x W^T in x's dtype, or None where the kernel does not run (CPU, pre-Ada GPUs, K not in whole groups)."""
    if not x.is_cuda or not has_fp8_dot(x.device.index or 0) or x.shape[-1] % block_k:
        return None
    lead = x.shape[:-1]
    y = w8a8_block_gemm(x.reshape(-1, x.shape[-1]).contiguous(), w_NK, scale_inv, block_n, block_k)
    return y.view(*lead, w_NK.shape[0])


FP8_LINEAR_KERNELS.register("triton")(fp8_linear_triton)
