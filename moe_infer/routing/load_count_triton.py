"""LOAD_COUNT_KERNELS["triton"]: a layer's expert-load counts in one launch (`moe_infer.kernels.expert_load`).
A plugin module (`moe_infer.plugins`): it imports triton, so it registers only where triton is installed;
`ExpertLoadStats.record` uses it for CUDA tensors.
"""
from moe_infer.kernels.expert_load import record_load_triton
from moe_infer.routing.stats import LOAD_COUNT_KERNELS

LOAD_COUNT_KERNELS.register("triton")(record_load_triton)
