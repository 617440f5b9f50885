"""Shared by the block-scaled FP8 kernel tests (test_fp8_gemm.py, test_fp8_fused_moe.py): tolerances, the kernels
(skipping where neither CUDA nor the Triton interpreter is there), random fp8 weights, scales and MoE cases."""
import os

import pytest
import torch

from moe_infer.kernels.fp8_ref import FP8_DTYPE, FP8_MAX, dequant_block_fp8_ref, per_token_group_quant_fp8_ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# float32 sums in another order: each of the <= K products and block partial sums is rounded at most
# K + 2 times (the two scale products), so |error| <= (K + 2) * 2^-24 * sum|terms|: 4e-6 at K = 64.
FP32_ORDER_RTOL = 1e-5
# One rounding to a 16-bit output on each side: the two may land one unit apart (2^-7 relative for bf16).
BF16_ULP = 2.0 ** -7
# Hopper's fp8 tensor cores accumulate a K block with about 14 bits of mantissa (DeepSeek-V3 report,
# section 3.3.2) before the float32 promotion at the scale multiply: 2^-14 relative to sum|terms| per
# block; 2^-10 leaves margin.
FP8_MMA_RTOL = 2.0 ** -10


def fp8_kernels():
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CUDA or under TRITON_INTERPRET=1")
    from moe_infer.kernels import fp8_gemm, fused_moe_fp8

    return fp8_gemm, fused_moe_fp8


def cdiv(a, b):
    return -(-a // b)


def fp8_weight(gen, *shape, device=DEVICE):
    """fp8 values spread over e4m3's range (as a checkpoint's, |w| up to 448)."""
    return (torch.randn(*shape, generator=gen, device=device) * 96).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def block_scale(gen, *lead, rows, cols, block_n, block_k, device=DEVICE):
    """Scales of a [rows, cols] weight: about 1 / (96 sqrt(cols)), so a product of unit inputs is about 1."""
    shape = (*lead, cdiv(rows, block_n), cdiv(cols, block_k))
    return (torch.rand(*shape, generator=gen, device=device) + 0.5) / (96 * cols ** 0.5)


def fake_quant(x_TK, group):
    q, s = per_token_group_quant_fp8_ref(x_TK, group)
    return q.double() * s.double().repeat_interleave(group, dim=1)


def sum_bound(x_TK, w_NK_fp8, scale, block_n, block_k):
    """sum_k |x_deq[t, k] * w_deq[n, k]| in float64: the scale of float32 summation errors."""
    w = dequant_block_fp8_ref(w_NK_fp8, scale, block_n, block_k).double()
    return fake_quant(x_TK, block_k).abs() @ w.abs().T


def moe_case(gen, T, D, F, E, K, bn, bk, dtype, device=DEVICE):
    x = torch.randn(T, D, generator=gen, device=device).to(dtype)
    w13, w2 = fp8_weight(gen, E, 2 * F, D, device=device), fp8_weight(gen, E, D, F, device=device)
    s13 = block_scale(gen, E, rows=2 * F, cols=D, block_n=bn, block_k=bk, device=device)
    s2 = block_scale(gen, E, rows=D, cols=F, block_n=bn, block_k=bk, device=device)
    scores = torch.rand(T, E, generator=gen, device=device)
    wts, ids = scores.topk(K, dim=1)
    return x, ids, wts / wts.sum(1, keepdim=True), w13, s13, w2, s2

