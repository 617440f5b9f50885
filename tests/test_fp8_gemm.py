"""Block-scaled FP8 (W8A8) activation quantization and GEMM (fp8_gemm.py) against their PyTorch references
(fp8_ref.py), and the references against independent checks; the fused MoE is test_fp8_fused_moe.py.

CPU: the Triton interpreter at tiny shapes (its dots run in float32 on the fp8 values, exact). The kernels
quantize exactly as the references do (IEEE division, round to nearest even), so quantization is compared
bit for bit and the GEMMs up to float32 summation order. GPU (`-m gpu`, H100/H200): DeepSeek-V3 shapes,
fp8 tensor-core dots.
"""
import pytest
import torch

from fp8_cases import (
    BF16_ULP, DEVICE, FP32_ORDER_RTOL, FP8_MMA_RTOL, block_scale, fake_quant, fp8_kernels, fp8_weight, sum_bound,
)
from moe_infer.kernels.fp8_ref import (
    FP8_DTYPE, FP8_MAX, dequant_block_fp8_ref, per_token_group_quant_fp8_ref, w8a8_block_gemm_ref,
)

pytestmark = pytest.mark.timeout(300)


# ---- references against independent checks -------------------------------------------------------------

@pytest.mark.parametrize("group", [16, 32])
def test_quant_ref_round_trip_error_bound(group):
    """|x - x_fp8 * scale| <= max(|x| 2^-4, scale 2^-10): half of e4m3's step (3 mantissa bits: 2^-3 of
    the value's binade) for normals, half the subnormal step 2^-9 below 2^-6; max |x_fp8| is 448."""
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(6, 128, generator=gen) * torch.logspace(-6, 3, 128)  # groups of very different sizes
    x[2, :group] = 0.0  # an all-zero group: a tiny finite scale, zeros back
    q, s = per_token_group_quant_fp8_ref(x, group)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 128 // group) and s.dtype == torch.float32
    s_full = s.repeat_interleave(group, dim=1)
    err = (x - q.float() * s_full).abs()
    assert (err <= torch.maximum(x.abs() * 2.0 ** -4, s_full * 2.0 ** -10) * (1 + 1e-6)).all()
    assert torch.isfinite(s).all() and (q.float()[2, :group] == 0).all()
    amax = q.float().abs().reshape(6, -1, group).amax(-1)
    assert (amax[s > 1e-9] == FP8_MAX).all()  # the largest value of each non-zero group maps to 448
    with pytest.raises(ValueError, match="multiple of the group"):
        per_token_group_quant_fp8_ref(x[:, :40], 16 if group == 32 else 32)


def test_dequant_ref_against_a_loop_with_partial_blocks():
    gen = torch.Generator().manual_seed(1)
    N, K, bn, bk = 40, 48, 16, 32  # 3 x 2 blocks, the last of each partial
    w = fp8_weight(gen, N, K, device="cpu")
    s = torch.rand(3, 2, generator=gen)
    out = dequant_block_fp8_ref(w, s, bn, bk)
    want = torch.tensor([[float(w[n, k]) * float(s[n // bn, k // bk]) for k in range(K)] for n in range(N)])
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="scale must be float32"):
        dequant_block_fp8_ref(w, s[:2], bn, bk)


@pytest.mark.parametrize("block_n,block_k", [(16, 16), (32, 32), (48, 16)])
def test_gemm_ref_against_a_float64_matmul_of_dequantized_operands(block_n, block_k):
    """The per-block formula equals fake-quantized x times the dequantized weight, up to float32 sums."""
    gen = torch.Generator().manual_seed(block_n + block_k)
    T, N, K = 5, 40, 64
    x = torch.randn(T, K, generator=gen)
    w = fp8_weight(gen, N, K, device="cpu")
    s = block_scale(gen, rows=N, cols=K, block_n=block_n, block_k=block_k, device="cpu")
    y = w8a8_block_gemm_ref(x, w, s, block_n, block_k, torch.float32)
    want = fake_quant(x, block_k) @ dequant_block_fp8_ref(w, s, block_n, block_k).double().T
    assert (y.double() - want).abs().max() <= FP32_ORDER_RTOL * sum_bound(x, w, s, block_n, block_k).max()
    assert (y.double() - want).abs().max() < 1e-3 * want.abs().max()  # and the bound is not vacuous
    assert w8a8_block_gemm_ref(x, w, s, block_n, block_k, torch.bfloat16).dtype == torch.bfloat16


# ---- Triton kernels against the references ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,group", [(0, 16), (1, 16), (3, 32), (5, 16)])
def test_quant_kernel_equals_ref(dtype, T, group):
    """Bit for bit (values: e4m3 has a -0 the interpreter writes as +0): scales and fp8 values."""
    fp8_gemm, _ = fp8_kernels()
    gen = torch.Generator().manual_seed(T)
    x = (torch.randn(T, 64, generator=gen) * torch.logspace(-3, 2, 64)).to(DEVICE, dtype)
    if T:
        x[0, :group] = 0.0  # an all-zero group
    q, s = fp8_gemm.per_token_group_quant_fp8(x, group)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, group)
    assert q.dtype == FP8_DTYPE and q.shape == (T, 64) and s.shape == (T, 64 // group)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


def test_quant_kernel_rounds_ties_to_even_and_carries_into_the_exponent():
    """One group whose max is 448 (scale 1): ties (1.0625 -> 1, 1.1875 -> 1.25, subnormal 3 * 2^-10 -> 2^-8)
    and values that round up into the next binade (31.9 -> 32, 0.01560 -> 2^-6) as torch rounds them."""
    fp8_gemm, _ = fp8_kernels()
    vals = [448.0, 1.0625, 1.1875, 31.9, -31.9, 0.0156, 3 * 2.0 ** -10, 5 * 2.0 ** -10, -1.0625, 240.0, 232.0,
            0.0, 7.9, 0.3, -100.0, 2.0 ** -12]
    x = torch.tensor([vals], device=DEVICE)
    q, s = fp8_gemm.per_token_group_quant_fp8(x, 16)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, 16)
    assert float(s) == 1.0 and torch.equal(q.float(), q_ref.float())
    assert q.float()[0, :4].tolist() == [448.0, 1.0, 1.25, 32.0]


def _assert_gemm_close(y, y_ref, bound):
    """float32 summation order (FP32_ORDER_RTOL of sum|terms|), plus a unit of a 16-bit output."""
    tol = FP32_ORDER_RTOL * bound
    if y.dtype != torch.float32:
        tol = tol + BF16_ULP * y_ref.double().abs()
    diff = (y.double() - y_ref.double()).abs()
    assert (diff <= tol).all(), f"max diff {diff.max():.3g}, tolerance there {tol.flatten()[diff.argmax()]:.3g}"


@pytest.mark.parametrize("block_n,block_k", [(16, 16), (32, 32), (48, 16)])
@pytest.mark.parametrize("T", [0, 1, 3, 5, 20])
def test_gemm_kernel_matches_ref(T, block_n, block_k):
    """N = 40: partial last weight block and column tile; T = 20 takes the 64-row tiles."""
    fp8_gemm, _ = fp8_kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(T * 7 + block_n)
    N, K = 40, 64
    w = fp8_weight(gen, N, K)
    s = block_scale(gen, rows=N, cols=K, block_n=block_n, block_k=block_k)
    x = torch.randn(T, K, generator=gen, device=DEVICE)
    bound = sum_bound(x, w, s, block_n, block_k)
    for dtype, out_dtype in ((torch.float32, None), (torch.bfloat16, torch.float32), (torch.bfloat16, None)):
        y = fp8_gemm.w8a8_block_gemm(x.to(dtype), w, s, block_n, block_k, out_dtype)
        y_ref = w8a8_block_gemm_ref(x.to(dtype), w, s, block_n, block_k, out_dtype or dtype)
        assert y.shape == (T, N) and y.dtype == (out_dtype or dtype)
        _assert_gemm_close(y, y_ref, bound)


@pytest.mark.parametrize("K", [256, 288])  # 16 and 18 K blocks of 16: split 4 ways, evenly and not
@pytest.mark.parametrize("T", [1, 5, 40])  # 16-row and 64-row tiles
def test_gemm_kernel_splits_k_for_few_tokens(T, K):
    """Few tokens: K split over programs (partial tiles summed after); the result is the unsplit reference's."""
    fp8_gemm, _ = fp8_kernels()
    N, block_n, block_k = 40, 16, 16
    tiles = fp8_gemm.gemm_tiles(T, N, K, block_k, num_sms=8)
    assert tiles.split_k == 4, tiles
    gen = torch.Generator(device=DEVICE).manual_seed(T + K)
    w = fp8_weight(gen, N, K)
    s = block_scale(gen, rows=N, cols=K, block_n=block_n, block_k=block_k)
    x = torch.randn(T, K, generator=gen, device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        y = fp8_gemm.w8a8_block_gemm(x.to(dtype), w, s, block_n, block_k)
        assert y.shape == (T, N) and y.dtype == dtype
        _assert_gemm_close(y, w8a8_block_gemm_ref(x.to(dtype), w, s, block_n, block_k, dtype),
                           sum_bound(x, w, s, block_n, block_k))


def test_gemm_kernel_reads_strided_rows():
    fp8_gemm, _ = fp8_kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    w = fp8_weight(gen, 32, 64)
    s = block_scale(gen, rows=32, cols=64, block_n=16, block_k=32)
    x = torch.randn(3, 100, generator=gen, device=DEVICE)[:, 20:84]  # row stride 100
    y = fp8_gemm.w8a8_block_gemm(x, w, s, 16, 32)
    _assert_gemm_close(y, w8a8_block_gemm_ref(x, w, s, 16, 32, torch.float32), sum_bound(x, w, s, 16, 32))


def test_gemm_wrapper_rejects_bad_inputs():
    fp8_gemm, _ = fp8_kernels()
    w = torch.zeros(32, 64, device=DEVICE).to(FP8_DTYPE)
    s = torch.ones(2, 2, device=DEVICE)
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm.w8a8_block_gemm(x, w.float(), s, 16, 32)
    with pytest.raises(ValueError, match="scale must be float32"):
        fp8_gemm.w8a8_block_gemm(x, w, s, 16, 16)
    with pytest.raises(ValueError, match="multiple of the group"):
        fp8_gemm.w8a8_block_gemm(x[:, :48], w[:, :48], s, 16, 32)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_gemm.w8a8_block_gemm(x, w, s, 16, 24)
    with pytest.raises(ValueError, match=r"x must be one of"):
        fp8_gemm.per_token_group_quant_fp8(x.to(torch.int32), 32)


# ---- GPU: DeepSeek-V3 shapes (D 7168, 128 x 128 blocks, bf16 activations), fp8 tensor-core dots ----------

@pytest.mark.gpu
def test_gpu_quant_equals_ref():
    fp8_gemm, _ = fp8_kernels()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(512, 7168, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    x[3, :128] = 0.0
    q, s = fp8_gemm.per_token_group_quant_fp8(x, 128)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, 128)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


@pytest.mark.gpu
@pytest.mark.parametrize("N", [2048, 4096])
@pytest.mark.parametrize("T", [1, 16, 64, 512])
def test_gpu_gemm_matches_ref(T, N):
    """FP8_MMA_RTOL of sum|terms| (the tensor cores' reduced-precision accumulation inside a block) plus
    a unit of the bf16 output."""
    fp8_gemm, _ = fp8_kernels()
    gen = torch.Generator(device="cuda").manual_seed(T + N)
    K, bn, bk = 7168, 128, 128
    w = fp8_weight(gen, N, K, device="cuda")
    s = block_scale(gen, rows=N, cols=K, block_n=bn, block_k=bk, device="cuda")
    x = torch.randn(T, K, generator=gen, device="cuda").to(torch.bfloat16)
    y = fp8_gemm.w8a8_block_gemm(x, w, s, bn, bk)
    y_ref = w8a8_block_gemm_ref(x, w, s, bn, bk, torch.bfloat16)
    q, xs = per_token_group_quant_fp8_ref(x, bk)
    bound = (q.float() * xs.repeat_interleave(bk, 1)).abs() @ dequant_block_fp8_ref(w, s, bn, bk).abs().T
    diff = (y.float() - y_ref.float()).abs()
    tol = FP8_MMA_RTOL * bound + BF16_ULP * y_ref.float().abs()
    assert y.dtype == torch.bfloat16 and (diff <= tol).all(), f"max diff {diff.max():.3g}"
