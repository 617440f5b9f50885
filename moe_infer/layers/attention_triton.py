"""ATTENTION_BACKENDS["triton"]: the step's K/V written with `store_kv`, then the paged Triton kernel
that reads K/V in place through the block tables (`moe_infer.kernels.paged_attention`). A plugin
module (`moe_infer.plugins`): it imports triton, so it registers only where triton is installed.

ROPE_FUSED_BACKENDS["triton"]: what the attention layer runs instead: the q/k norm (where the layer can
fuse it), the rotary embedding and the K/V write as one kernel (`moe_infer.kernels.rope_kv`), then the same
paged kernel (one launch per layer in place of the ~30 of RotaryEmbedding.forward + store_kv and the two
norm launches; outputs bit-identical but for a rare ulp of the norm's float32 sum order). A decode step
(one query token a sequence) runs both as one kernel where its head size and norm allow
(`moe_infer.kernels.rope_decode_attention`).

The CUDA default ("auto" in ATTENTION_AUTO): on an H100 it measured 4.4-38x faster than the
gather + SDPA path for decode and 4.5-9.9x for prefill/extend (`benchmarks/attention.py`). Eagerly,
the SDPA path also paid about 70 ms of host time the first time it met each context length (1.3 ms
after), this kernel 0.2 ms either way (`benchmarks/trials/sdpa_cudnn_check.py`): every eager step
(prefill, offload, meshes) met a new length.
"""
from moe_infer.kernels.paged_attention import paged_attention_triton
from moe_infer.kernels.rope_decode_attention import rope_decode_attention, supports
from moe_infer.kernels.rope_kv import rope_store_kv
from moe_infer.layers.paged_attention import (
    ATTENTION_BACKENDS, ROPE_FUSED_BACKENDS, RopeFusedAttention, store_then_attend,
)

_triton = store_then_attend(paged_attention_triton)
# every launch parameter comes from shapes and the metadata's host ints, never from the data: steps with any
# query lengths can be captured as CUDA graphs (moe_infer/engine/extend_graph.py)
_triton.static_launch = True
ATTENTION_BACKENDS.register("triton")(_triton)
ROPE_FUSED_BACKENDS.register("triton")(
    RopeFusedAttention(rope_store_kv, paged_attention_triton, rope_decode_attention, supports))
