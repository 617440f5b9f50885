"""Block-scaled FP8 (W8A8) kernels (fp8_gemm.py, fused_moe_fp8.py) against their PyTorch references
(fp8_ref.py), and the references against independent checks.

CPU: the Triton interpreter at tiny shapes (its dots run in float32 on the fp8 values, exact). The kernels
quantize exactly as the references do (IEEE division, round to nearest even), so quantization is compared
bit for bit and the GEMMs up to float32 summation order. GPU (`-m gpu`, H100/H200): DeepSeek-V3 shapes,
fp8 tensor-core dots.
"""
import os

import pytest
import torch

from moe_infer.kernels.fp8_ref import (
    FP8_DTYPE, FP8_MAX, dequant_block_fp8_ref, fused_moe_fp8_ref, per_token_group_quant_fp8_ref, w8a8_block_gemm_ref,
)

pytestmark = pytest.mark.timeout(300)

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
# The fused MoE requantizes the intermediate: where the kernel's float32 value and the reference's fall on
# either side of an e4m3 rounding midpoint (GPU accumulation order), that element moves one e4m3 step
# (<= 1/8 of it). Spread over F products, a few such flips stay far below 2e-2 of the output's norm.
# Measured on an H200 (T 16 / 256 at E 16): 5e-5 with 16-row tiles (mma.sync, float32 sums), 6e-3 with
# 64-row tiles (fp8 wgmma); both the kernel and the reference are 4.5e-2 from the unquantized float32 MoE.
FUSED_GPU_RTOL = 2e-2


def _kernels():
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CUDA or under TRITON_INTERPRET=1")
    from moe_infer.kernels import fp8_gemm, fused_moe_fp8

    return fp8_gemm, fused_moe_fp8


def _cdiv(a, b):
    return -(-a // b)


def _fp8_weight(gen, *shape, device=DEVICE):
    """fp8 values spread over e4m3's range (as a checkpoint's, |w| up to 448)."""
    return (torch.randn(*shape, generator=gen, device=device) * 96).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _block_scale(gen, *lead, rows, cols, block_n, block_k, device=DEVICE):
    """Scales of a [rows, cols] weight: about 1 / (96 sqrt(cols)), so a product of unit inputs is about 1."""
    shape = (*lead, _cdiv(rows, block_n), _cdiv(cols, block_k))
    return (torch.rand(*shape, generator=gen, device=device) + 0.5) / (96 * cols ** 0.5)


def _fake_quant(x_TK, group):
    q, s = per_token_group_quant_fp8_ref(x_TK, group)
    return q.double() * s.double().repeat_interleave(group, dim=1)


def _sum_bound(x_TK, w_NK_fp8, scale, block_n, block_k):
    """sum_k |x_deq[t, k] * w_deq[n, k]| in float64: the scale of float32 summation errors."""
    w = dequant_block_fp8_ref(w_NK_fp8, scale, block_n, block_k).double()
    return _fake_quant(x_TK, block_k).abs() @ w.abs().T


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
    w = _fp8_weight(gen, N, K, device="cpu")
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
    w = _fp8_weight(gen, N, K, device="cpu")
    s = _block_scale(gen, rows=N, cols=K, block_n=block_n, block_k=block_k, device="cpu")
    y = w8a8_block_gemm_ref(x, w, s, block_n, block_k, torch.float32)
    want = _fake_quant(x, block_k) @ dequant_block_fp8_ref(w, s, block_n, block_k).double().T
    assert (y.double() - want).abs().max() <= FP32_ORDER_RTOL * _sum_bound(x, w, s, block_n, block_k).max()
    assert (y.double() - want).abs().max() < 1e-3 * want.abs().max()  # and the bound is not vacuous
    assert w8a8_block_gemm_ref(x, w, s, block_n, block_k, torch.bfloat16).dtype == torch.bfloat16


def test_fused_ref_against_a_dense_float64_moe():
    """Routing weights, gate rows before up rows, SiLU, -1 ids: each expert as float64 matmuls of the
    dequantized weights and fake-quantized inputs."""
    gen = torch.Generator().manual_seed(3)
    T, D, F, E, K, bn, bk = 4, 64, 32, 4, 2, 32, 16
    x = torch.randn(T, D, generator=gen)
    w13, w2 = _fp8_weight(gen, E, 2 * F, D, device="cpu"), _fp8_weight(gen, E, D, F, device="cpu")
    s13 = _block_scale(gen, E, rows=2 * F, cols=D, block_n=bn, block_k=bk, device="cpu")
    s2 = _block_scale(gen, E, rows=D, cols=F, block_n=bn, block_k=bk, device="cpu")
    ids = torch.tensor([[0, 3], [2, -1], [-1, -1], [1, 1]])
    wts = torch.rand(T, K, generator=gen)
    out = fused_moe_fp8_ref(x, ids, wts, w13, s13, w2, s2, bn, bk)
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e >= 0:
                gu = _fake_quant(x[t:t + 1], bk) @ dequant_block_fp8_ref(w13[e], s13[e], bn, bk).double().T
                act = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
                down = _fake_quant(act.float(), bk) @ dequant_block_fp8_ref(w2[e], s2[e], bn, bk).double().T
                want[t] += float(wts[t, k]) * down[0]
    assert (out[2] == 0).all()
    assert (out.double() - want).abs().max() <= 1e-4 * want.abs().max()  # float32 vs float64 sums, 2 GEMMs


# ---- Triton kernels against the references ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,group", [(0, 16), (1, 16), (3, 32), (5, 16)])
def test_quant_kernel_equals_ref(dtype, T, group):
    """Bit for bit (values: e4m3 has a -0 the interpreter writes as +0): scales and fp8 values."""
    fp8_gemm, _ = _kernels()
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
    fp8_gemm, _ = _kernels()
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
    fp8_gemm, _ = _kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(T * 7 + block_n)
    N, K = 40, 64
    w = _fp8_weight(gen, N, K)
    s = _block_scale(gen, rows=N, cols=K, block_n=block_n, block_k=block_k)
    x = torch.randn(T, K, generator=gen, device=DEVICE)
    bound = _sum_bound(x, w, s, block_n, block_k)
    for dtype, out_dtype in ((torch.float32, None), (torch.bfloat16, torch.float32), (torch.bfloat16, None)):
        y = fp8_gemm.w8a8_block_gemm(x.to(dtype), w, s, block_n, block_k, out_dtype)
        y_ref = w8a8_block_gemm_ref(x.to(dtype), w, s, block_n, block_k, out_dtype or dtype)
        assert y.shape == (T, N) and y.dtype == (out_dtype or dtype)
        _assert_gemm_close(y, y_ref, bound)


@pytest.mark.parametrize("K", [256, 288])  # 16 and 18 K blocks of 16: split 4 ways, evenly and not
@pytest.mark.parametrize("T", [1, 5, 40])  # 16-row and 64-row tiles
def test_gemm_kernel_splits_k_for_few_tokens(T, K):
    """Few tokens: K split over programs (partial tiles summed after); the result is the unsplit reference's."""
    fp8_gemm, _ = _kernels()
    N, block_n, block_k = 40, 16, 16
    tiles = fp8_gemm.gemm_tiles(T, N, K, block_k, num_sms=8)
    assert tiles.split_k == 4, tiles
    gen = torch.Generator(device=DEVICE).manual_seed(T + K)
    w = _fp8_weight(gen, N, K)
    s = _block_scale(gen, rows=N, cols=K, block_n=block_n, block_k=block_k)
    x = torch.randn(T, K, generator=gen, device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        y = fp8_gemm.w8a8_block_gemm(x.to(dtype), w, s, block_n, block_k)
        assert y.shape == (T, N) and y.dtype == dtype
        _assert_gemm_close(y, w8a8_block_gemm_ref(x.to(dtype), w, s, block_n, block_k, dtype),
                           _sum_bound(x, w, s, block_n, block_k))


def test_gemm_kernel_reads_strided_rows():
    fp8_gemm, _ = _kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    w = _fp8_weight(gen, 32, 64)
    s = _block_scale(gen, rows=32, cols=64, block_n=16, block_k=32)
    x = torch.randn(3, 100, generator=gen, device=DEVICE)[:, 20:84]  # row stride 100
    y = fp8_gemm.w8a8_block_gemm(x, w, s, 16, 32)
    _assert_gemm_close(y, w8a8_block_gemm_ref(x, w, s, 16, 32, torch.float32), _sum_bound(x, w, s, 16, 32))


def test_gemm_wrapper_rejects_bad_inputs():
    fp8_gemm, _ = _kernels()
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


def _moe_case(gen, T, D, F, E, K, bn, bk, dtype, device=DEVICE):
    x = torch.randn(T, D, generator=gen, device=device).to(dtype)
    w13, w2 = _fp8_weight(gen, E, 2 * F, D, device=device), _fp8_weight(gen, E, D, F, device=device)
    s13 = _block_scale(gen, E, rows=2 * F, cols=D, block_n=bn, block_k=bk, device=device)
    s2 = _block_scale(gen, E, rows=D, cols=F, block_n=bn, block_k=bk, device=device)
    scores = torch.rand(T, E, generator=gen, device=device)
    wts, ids = scores.topk(K, dim=1)
    return x, ids, wts / wts.sum(1, keepdim=True), w13, s13, w2, s2


# The fused kernel and the reference agree up to float32 order (and, for 16-bit x, one unit of the output):
# the intermediate's requantization could flip at a rounding midpoint, which these fixed seeds do not hit.
FUSED_CPU_RTOL = 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,bn,bk", [(0, 16, 16), (1, 16, 16), (3, 48, 16), (5, 32, 32), (40, 16, 16)])
def test_fused_moe_kernel_matches_ref(T, bn, bk, dtype):
    """D 64, F 32, E 4, K 2; block_n 48: partial last scale blocks of w13 (2F = 64) and w2 (D = 64); a
    dropped (-1) row and a token with both rows dropped (zeros); T = 40 (80 rows): 64-row tiles."""
    _, fm = _kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(T + bn + bk)
    case = _moe_case(gen, T, 64, 32, 4, 2, bn, bk, dtype)
    x, ids = case[0], case[1]
    if T >= 3:
        ids[1, 0] = -1
        ids[2, :] = -1
    out = fm.fused_moe_fp8(*case, bn, bk)
    ref = fused_moe_fp8_ref(*case, bn, bk)
    assert out.shape == x.shape and out.dtype == dtype
    if T >= 3:
        assert (out[2] == 0).all()
    ref_max = ref.float().abs().max() if ref.numel() else 0.0
    tol = FUSED_CPU_RTOL * ref_max + (BF16_ULP * ref.float().abs() if dtype != torch.float32 else 0)
    diff = (out.float() - ref.float()).abs()
    assert (diff <= tol).all(), f"max diff {diff.max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,F,E,K,bn,bk", [(64, 32, 4, 2, 16, 16), (80, 48, 6, 3, 48, 16), (64, 64, 8, 8, 32, 32)])
def test_one_token_gemv_matches_ref_and_the_tile_path(D, F, E, K, bn, bk, dtype):
    """One token goes through fp8_expert_gemv (the kernels quantize x and the intermediate in their prologues); it
    agrees with the reference and with the tile path (forced by a config) up to float32 order. D 80 at block_k 16:
    5 groups, a partial group tile (4 a step); K 3: a padded row; block_n 48: partial scale blocks; a dropped row."""
    _, fm = _kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(D + F + K)
    case = _moe_case(gen, 1, D, F, E, K, bn, bk, dtype)
    case[1][0, 1] = -1
    out = fm.fused_moe_fp8(*case, bn, bk)
    tiles = fm.fused_moe_fp8(*case, bn, bk, config=fm.MoETiles(16, 32))
    ref = fused_moe_fp8_ref(*case, bn, bk)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = FUSED_CPU_RTOL * ref.float().abs().max() + (BF16_ULP * ref.float().abs() if dtype != torch.float32 else 0)
    for got in (out, tiles):
        diff = (got.float() - ref.float()).abs()
        assert (diff <= tol).all(), f"max diff {diff.max():.3g}"


def test_one_token_takes_the_gemv_and_a_dropped_token_gets_zeros(monkeypatch):
    _, fm = _kernels()
    from moe_infer.kernels import fp8_expert_gemv

    calls = []
    monkeypatch.setattr(fm, "fp8_expert_gemv", lambda *a, **k: calls.append(1) or fp8_expert_gemv.fp8_expert_gemv(*a))
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    case = _moe_case(gen, 1, 64, 32, 4, 2, 16, 16, torch.float32)
    case[1][:] = -1
    assert (fm.fused_moe_fp8(*case, 16, 16) == 0).all() and calls == [1]
    fm.fused_moe_fp8(*_moe_case(gen, 2, 64, 32, 4, 2, 16, 16, torch.float32), 16, 16)
    monkeypatch.setenv("MOE_EXPERT_GEMV", "0")
    fm.fused_moe_fp8(*_moe_case(gen, 1, 64, 32, 4, 2, 16, 16, torch.float32), 16, 16)
    assert calls == [1]


@pytest.mark.parametrize("tiles", [(32, 64, 1, 4, 3, 8, 4), (64, 128, 8, 8, 3, 4, 3), (128, 16, 8, 4, 4, 4, 4)])
def test_tile_path_with_the_tuner_s_tiles(tiles):
    """Every BLOCK_M the fp8 tuner tries (16 above) and down's own tile, warps and stages give the reference's
    result (the tuner keeps the fastest, so a wrong tile must fail here, not be picked)."""
    _, fm = _kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(tiles[0])
    case = _moe_case(gen, 6, 64, 32, 4, 2, 16, 16, torch.float32)
    out = fm.fused_moe_fp8(*case, 16, 16, config=fm.MoETiles(*tiles))
    ref = fused_moe_fp8_ref(*case, 16, 16)
    diff = (out - ref).abs()
    assert (diff <= FUSED_CPU_RTOL * ref.abs().max()).all(), f"max diff {diff.max():.3g}"


@pytest.mark.parametrize("T", [1, 5])
def test_ids_past_the_local_experts_add_nothing(T):
    """An id >= E (another rank's expert, as the engine hands them at expert_start 0) is skipped, as -1 is:
    the gemv (T 1) and the tile path (schedule, kernels, combine)."""
    _, fm = _kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(T)
    case = list(_moe_case(gen, T, 64, 32, 4, 2, 16, 16, torch.float32))
    ids = case[1]
    ids[0, 0] = 4
    ids[-1, 1] = 9
    out = fm.fused_moe_fp8(*case, 16, 16)
    ref = fused_moe_fp8_ref(*case[:1], torch.where(ids >= 4, -1, ids), *case[2:], 16, 16)
    diff = (out - ref).abs()
    assert (diff <= FUSED_CPU_RTOL * ref.abs().max()).all(), f"max diff {diff.max():.3g}"


def test_fused_moe_rejects_bad_inputs():
    _, fm = _kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x, ids, wts, w13, s13, w2, s2 = _moe_case(gen, 2, 64, 32, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="w13's scale"):
        fm.fused_moe_fp8(x, ids, wts, w13, s13[:, :1], w2, s2, 16, 16)
    with pytest.raises(ValueError, match="power of two dividing"):
        fm.fused_moe_fp8(x, ids, wts, w13, s13[:, :, :1], w2, s2[:, :, :1], 16, 64)
    with pytest.raises(ValueError, match="disagree"):
        fm.fused_moe_fp8(x, ids[:1], wts, w13, s13, w2, s2, 16, 16)


# ---- GPU: DeepSeek-V3 shapes (D 7168, 128 x 128 blocks, bf16 activations), fp8 tensor-core dots ----------

@pytest.mark.gpu
def test_gpu_quant_equals_ref():
    fp8_gemm, _ = _kernels()
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
    fp8_gemm, _ = _kernels()
    gen = torch.Generator(device="cuda").manual_seed(T + N)
    K, bn, bk = 7168, 128, 128
    w = _fp8_weight(gen, N, K, device="cuda")
    s = _block_scale(gen, rows=N, cols=K, block_n=bn, block_k=bk, device="cuda")
    x = torch.randn(T, K, generator=gen, device="cuda").to(torch.bfloat16)
    y = fp8_gemm.w8a8_block_gemm(x, w, s, bn, bk)
    y_ref = w8a8_block_gemm_ref(x, w, s, bn, bk, torch.bfloat16)
    q, xs = per_token_group_quant_fp8_ref(x, bk)
    bound = (q.float() * xs.repeat_interleave(bk, 1)).abs() @ dequant_block_fp8_ref(w, s, bn, bk).abs().T
    diff = (y.float() - y_ref.float()).abs()
    tol = FP8_MMA_RTOL * bound + BF16_ULP * y_ref.float().abs()
    assert y.dtype == torch.bfloat16 and (diff <= tol).all(), f"max diff {diff.max():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("E", [16, 32])
@pytest.mark.parametrize("T", [1, 16, 64, 256])
def test_gpu_fused_moe_matches_ref(T, E):
    """D 7168, F 2048, K 8, 128 x 128 blocks, bf16; dropped (-1) rows. Each token's output within
    FUSED_GPU_RTOL of the reference's (relative 2-norm)."""
    _, fm = _kernels()
    gen = torch.Generator(device="cuda").manual_seed(T + E)
    case = _moe_case(gen, T, 7168, 2048, E, 8, 128, 128, torch.bfloat16, device="cuda")
    case[1][0, -1] = -1
    out = fm.fused_moe_fp8(*case, 128, 128)
    ref = fused_moe_fp8_ref(*case, 128, 128).float()
    err = (out.float() - ref).norm(dim=1) / ref.norm(dim=1)
    assert out.dtype == torch.bfloat16 and (err <= FUSED_GPU_RTOL).all(), f"worst token: {err.max():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])
def test_gpu_kernels_capture_in_a_cuda_graph(T):
    """Replays of captured launches with new inputs (copied into the captured buffers) give the eager output
    (T 1: the one-token matrix-vector kernels)."""
    fp8_gemm, fm = _kernels()
    gen = torch.Generator(device="cuda").manual_seed(5)
    x, ids, wts, w13, s13, w2, s2 = _moe_case(gen, T, 1024, 256, 8, 4, 128, 128, torch.bfloat16, device="cuda")
    w, s = w13[0], s13[0]
    fm.fused_moe_fp8(x, ids, wts, w13, s13, w2, s2, 128, 128)  # compile before capture
    fp8_gemm.w8a8_block_gemm(x, w, s, 128, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe_fp8(x, ids, wts, w13, s13, w2, s2, 128, 128)
        y = fp8_gemm.w8a8_block_gemm(x, w, s, 128, 128)
    for seed in (1, 2):
        new = _moe_case(torch.Generator(device="cuda").manual_seed(seed), T, 1024, 256, 8, 4, 128, 128,
                        torch.bfloat16, device="cuda")
        for buf, src in zip((x, ids, wts), new[:3]):
            buf.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fm.fused_moe_fp8(x, ids, wts, w13, s13, w2, s2, 128, 128))
        assert torch.equal(y, fp8_gemm.w8a8_block_gemm(x, w, s, 128, 128))
