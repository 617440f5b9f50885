"""RMS_NORM_KERNELS["triton"]: the one-launch RMSNorm (and residual add + RMSNorm) of
`moe_infer.kernels.rms_norm`. A plugin module (`moe_infer.plugins`): it imports triton, so it
registers only where triton is installed; RMSNorm uses it for CUDA tensors.
"""
from moe_infer.kernels.rms_norm import add_rms_norm_triton, rms_norm_triton
from moe_infer.layers.norm import RMS_NORM_KERNELS, NormKernel

RMS_NORM_KERNELS.register("triton")(NormKernel(rms_norm_triton, add_rms_norm_triton))
