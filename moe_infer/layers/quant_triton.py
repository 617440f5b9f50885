"""FP8_LINEAR_KERNELS["triton"]: the W8A8 block-scaled GEMM (`moe_infer.kernels.fp8_gemm`: activations quantized per
token and 128-wide group, fp8 tensor-core dots, the block scales applied per K-block) for fp8 weights on a CUDA
device of compute capability 8.9 or more (Ada, Hopper); elsewhere it declines and `linear_fp8` dequantizes.
W4_LINEAR_KERNELS["triton"]: the W4A16 GEMM (`moe_infer.kernels.fused_moe_w4a16.w4a16_gemm`) for int4 / mxfp4 dense
weights on CUDA; on the CPU it declines and `linear_quantized` dequantizes. A plugin
module (`moe_infer.plugins`): it imports triton, so it registers only where triton is installed."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from moe_infer.kernels.fp8_gemm import w8a8_block_gemm
from moe_infer.kernels.fused_moe_w4a16 import w4a16_gemm
from moe_infer.quant import FP8_LINEAR_KERNELS, W4_LINEAR_KERNELS


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


def w4_linear_triton(x: torch.Tensor, w_packed: torch.Tensor, fmt) -> Optional[torch.Tensor]:
    """y = x W^T in x's dtype through the W4A16 GEMM, or None off CUDA."""
    if not x.is_cuda:
        return None
    lead = x.shape[:-1]
    group = getattr(fmt, "group_size", 32)
    y = w4a16_gemm(x.reshape(-1, x.shape[-1]).contiguous(), w_packed, fmt.scale, group, getattr(fmt, "zero", None),
                   fmt.fmt)
    return y.view(*lead, w_packed.shape[0])


W4_LINEAR_KERNELS.register("triton")(w4_linear_triton)
