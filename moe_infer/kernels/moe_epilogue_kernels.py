"""The fused experts' GEMM epilogues in Triton (what they compute, and their PyTorch side: moe_epilogue.py): the
gate/up bias and the activation (SiLU * up, or GPT-OSS's clamped SwiGLU: CLAMPED), and the down bias.

Legend: M rows of a tile, n columns of a tile, F expert intermediate.
"""
import triton
import triton.language as tl


@triton.jit
def gate_up_epilogue(acc_g, acc_u, b13_ptr, e, offs_n, is_n, F, stride_be, HAS_BIAS: tl.constexpr,
                     CLAMPED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """act [M, n] (float32) of the gate and up accumulators of expert e's columns offs_n."""
    if HAS_BIAS:
        b_ptrs = b13_ptr + e * stride_be + offs_n
        acc_g += tl.load(b_ptrs, mask=is_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + F, mask=is_n, other=0.0).to(tl.float32)[None, :]
    if CLAMPED:
        g = tl.minimum(acc_g, LIMIT)
        u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT)
        act = (u + 1.0) * (g * tl.sigmoid(g * ALPHA))
    else:
        act = acc_g * tl.sigmoid(acc_g) * acc_u
    return act


@triton.jit
def down_epilogue(acc, b2_ptr, e, offs_n, is_n, stride_b2e, HAS_BIAS2: tl.constexpr):
    """acc [M, n] + expert e's down bias at columns offs_n (before the routing weight)."""
    if HAS_BIAS2:
        acc += tl.load(b2_ptr + e * stride_b2e + offs_n, mask=is_n, other=0.0).to(tl.float32)[None, :]
    return acc
