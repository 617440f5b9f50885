"""ATTENTION_BACKENDS["triton"]: the step's K/V written with `store_kv`, then the paged Triton kernel
that reads K/V in place through the block tables (`moe_infer.kernels.paged_attention`). A plugin
module (`moe_infer.plugins`): it imports triton, so it registers only where triton is installed.

Chosen with `model.attention_backend=triton`. It is not in ATTENTION_AUTO yet: "auto" keeps the
SDPA path on CUDA until `benchmarks/attention.py` and `benchmarks/e2e_generate.py --attention`
show the kernel faster on the device.
"""
from moe_infer.kernels.paged_attention import paged_attention_triton
from moe_infer.layers.paged_attention import ATTENTION_BACKENDS, store_then_attend

ATTENTION_BACKENDS.register("triton")(store_then_attend(paged_attention_triton))
