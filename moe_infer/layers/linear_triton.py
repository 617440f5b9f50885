"""LINEAR_KERNELS["triton"]: the skinny GEMM of `moe_infer.kernels.skinny_gemm` for decode-sized linear
layers. A plugin module (`moe_infer.plugins`): it imports triton, so it registers only where triton is
installed. MOE_SKINNY_GEMM=0 in the environment leaves it unregistered (cuBLAS everywhere: A/B runs).
"""
import os

from moe_infer.kernels.skinny_gemm import is_faster_than_cublas, skinny_gemm
from moe_infer.layers.linear import LINEAR_KERNELS, SmallLinearKernel

if os.environ.get("MOE_SKINNY_GEMM", "1") != "0":
    LINEAR_KERNELS.register("triton")(SmallLinearKernel(is_faster_than_cublas, skinny_gemm))
