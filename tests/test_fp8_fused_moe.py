"""The block-scaled FP8 fused MoE (fused_moe_fp8.py) against its PyTorch reference (fp8_ref.py), the reference
against a dense float64 MoE, and both FP8 kernels captured in a CUDA graph; the quantization and GEMM kernels are
test_fp8_gemm.py.

CPU: the Triton interpreter at tiny shapes (float32 dots on the fp8 values); the fused kernel and the reference agree
up to float32 summation order. GPU (`-m gpu`, H100/H200): DeepSeek-V3 shapes, fp8 tensor-core dots.
"""
import pytest
import torch

from fp8_cases import BF16_ULP, DEVICE, block_scale, fake_quant, fp8_kernels, fp8_weight, moe_case
from moe_infer.kernels.fp8_ref import dequant_block_fp8_ref, fused_moe_fp8_ref

pytestmark = pytest.mark.timeout(300)

# The fused MoE requantizes the intermediate: where the kernel's float32 value and the reference's fall on
# either side of an e4m3 rounding midpoint (GPU accumulation order), that element moves one e4m3 step
# (<= 1/8 of it). Spread over F products, a few such flips stay far below 2e-2 of the output's norm.
# Measured on an H200 (T 16 / 256 at E 16): 5e-5 with 16-row tiles (mma.sync, float32 sums), 6e-3 with
# 64-row tiles (fp8 wgmma); both the kernel and the reference are 4.5e-2 from the unquantized float32 MoE.
FUSED_GPU_RTOL = 2e-2


# ---- the reference against an independent check ---------------------------------------------------------

def test_fused_ref_against_a_dense_float64_moe():
    """Routing weights, gate rows before up rows, SiLU, -1 ids: each expert as float64 matmuls of the
    dequantized weights and fake-quantized inputs."""
    gen = torch.Generator().manual_seed(3)
    T, D, F, E, K, bn, bk = 4, 64, 32, 4, 2, 32, 16
    x = torch.randn(T, D, generator=gen)
    w13, w2 = fp8_weight(gen, E, 2 * F, D, device="cpu"), fp8_weight(gen, E, D, F, device="cpu")
    s13 = block_scale(gen, E, rows=2 * F, cols=D, block_n=bn, block_k=bk, device="cpu")
    s2 = block_scale(gen, E, rows=D, cols=F, block_n=bn, block_k=bk, device="cpu")
    ids = torch.tensor([[0, 3], [2, -1], [-1, -1], [1, 1]])
    wts = torch.rand(T, K, generator=gen)
    out = fused_moe_fp8_ref(x, ids, wts, w13, s13, w2, s2, bn, bk)
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e >= 0:
                gu = fake_quant(x[t:t + 1], bk) @ dequant_block_fp8_ref(w13[e], s13[e], bn, bk).double().T
                act = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
                down = fake_quant(act.float(), bk) @ dequant_block_fp8_ref(w2[e], s2[e], bn, bk).double().T
                want[t] += float(wts[t, k]) * down[0]
    assert (out[2] == 0).all()
    assert (out.double() - want).abs().max() <= 1e-4 * want.abs().max()  # float32 vs float64 sums, 2 GEMMs


# ---- the Triton kernel against the reference -------------------------------------------------------------

# The fused kernel and the reference agree up to float32 order (and, for 16-bit x, one unit of the output):
# the intermediate's requantization could flip at a rounding midpoint, which these fixed seeds do not hit.
FUSED_CPU_RTOL = 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,bn,bk", [(0, 16, 16), (1, 16, 16), (3, 48, 16), (5, 32, 32), (40, 16, 16)])
def test_fused_moe_kernel_matches_ref(T, bn, bk, dtype):
    """D 64, F 32, E 4, K 2; block_n 48: partial last scale blocks of w13 (2F = 64) and w2 (D = 64); a
    dropped (-1) row and a token with both rows dropped (zeros); T = 40 (80 rows): 64-row tiles."""
    _, fm = fp8_kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(T + bn + bk)
    case = moe_case(gen, T, 64, 32, 4, 2, bn, bk, dtype)
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
    _, fm = fp8_kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(D + F + K)
    case = moe_case(gen, 1, D, F, E, K, bn, bk, dtype)
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
    _, fm = fp8_kernels()
    from moe_infer.kernels import fp8_expert_gemv

    calls = []
    monkeypatch.setattr(fm, "fp8_expert_gemv", lambda *a, **k: calls.append(1) or fp8_expert_gemv.fp8_expert_gemv(*a))
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    case = moe_case(gen, 1, 64, 32, 4, 2, 16, 16, torch.float32)
    case[1][:] = -1
    assert (fm.fused_moe_fp8(*case, 16, 16) == 0).all() and calls == [1]
    fm.fused_moe_fp8(*moe_case(gen, 2, 64, 32, 4, 2, 16, 16, torch.float32), 16, 16)
    monkeypatch.setenv("MOE_EXPERT_GEMV", "0")
    fm.fused_moe_fp8(*moe_case(gen, 1, 64, 32, 4, 2, 16, 16, torch.float32), 16, 16)
    assert calls == [1]


@pytest.mark.parametrize("tiles", [(32, 64, 1, 4, 3, 8, 4), (64, 128, 8, 8, 3, 4, 3), (128, 16, 8, 4, 4, 4, 4)])
def test_tile_path_with_the_tuner_s_tiles(tiles):
    """Every BLOCK_M the fp8 tuner tries (16 above) and down's own tile, warps and stages give the reference's
    result (the tuner keeps the fastest, so a wrong tile must fail here, not be picked)."""
    _, fm = fp8_kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(tiles[0])
    case = moe_case(gen, 6, 64, 32, 4, 2, 16, 16, torch.float32)
    out = fm.fused_moe_fp8(*case, 16, 16, config=fm.MoETiles(*tiles))
    ref = fused_moe_fp8_ref(*case, 16, 16)
    diff = (out - ref).abs()
    assert (diff <= FUSED_CPU_RTOL * ref.abs().max()).all(), f"max diff {diff.max():.3g}"


@pytest.mark.parametrize("T", [1, 5])
def test_ids_past_the_local_experts_add_nothing(T):
    """An id >= E (another rank's expert, as the engine hands them at expert_start 0) is skipped, as -1 is:
    the gemv (T 1) and the tile path (schedule, kernels, combine)."""
    _, fm = fp8_kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(T)
    case = list(moe_case(gen, T, 64, 32, 4, 2, 16, 16, torch.float32))
    ids = case[1]
    ids[0, 0] = 4
    ids[-1, 1] = 9
    out = fm.fused_moe_fp8(*case, 16, 16)
    ref = fused_moe_fp8_ref(*case[:1], torch.where(ids >= 4, -1, ids), *case[2:], 16, 16)
    diff = (out - ref).abs()
    assert (diff <= FUSED_CPU_RTOL * ref.abs().max()).all(), f"max diff {diff.max():.3g}"


def test_fused_moe_rejects_bad_inputs():
    _, fm = fp8_kernels()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x, ids, wts, w13, s13, w2, s2 = moe_case(gen, 2, 64, 32, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="w13's scale"):
        fm.fused_moe_fp8(x, ids, wts, w13, s13[:, :1], w2, s2, 16, 16)
    with pytest.raises(ValueError, match="power of two dividing"):
        fm.fused_moe_fp8(x, ids, wts, w13, s13[:, :, :1], w2, s2[:, :, :1], 16, 64)
    with pytest.raises(ValueError, match="disagree"):
        fm.fused_moe_fp8(x, ids[:1], wts, w13, s13, w2, s2, 16, 16)


# ---- GPU: DeepSeek-V3 shapes (D 7168, 128 x 128 blocks, bf16 activations), fp8 tensor-core dots ----------

@pytest.mark.gpu
@pytest.mark.parametrize("E", [16, 32])
@pytest.mark.parametrize("T", [1, 16, 64, 256])
def test_gpu_fused_moe_matches_ref(T, E):
    """D 7168, F 2048, K 8, 128 x 128 blocks, bf16; dropped (-1) rows. Each token's output within
    FUSED_GPU_RTOL of the reference's (relative 2-norm)."""
    _, fm = fp8_kernels()
    gen = torch.Generator(device="cuda").manual_seed(T + E)
    case = moe_case(gen, T, 7168, 2048, E, 8, 128, 128, torch.bfloat16, device="cuda")
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
    fp8_gemm, fm = fp8_kernels()
    gen = torch.Generator(device="cuda").manual_seed(5)
    x, ids, wts, w13, s13, w2, s2 = moe_case(gen, T, 1024, 256, 8, 4, 128, 128, torch.bfloat16, device="cuda")
    w, s = w13[0], s13[0]
    fm.fused_moe_fp8(x, ids, wts, w13, s13, w2, s2, 128, 128)  # compile before capture
    fp8_gemm.w8a8_block_gemm(x, w, s, 128, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe_fp8(x, ids, wts, w13, s13, w2, s2, 128, 128)
        y = fp8_gemm.w8a8_block_gemm(x, w, s, 128, 128)
    for seed in (1, 2):
        new = moe_case(torch.Generator(device="cuda").manual_seed(seed), T, 1024, 256, 8, 4, 128, 128,
                        torch.bfloat16, device="cuda")
        for buf, src in zip((x, ids, wts), new[:3]):
            buf.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fm.fused_moe_fp8(x, ids, wts, w13, s13, w2, s2, 128, 128))
        assert torch.equal(y, fp8_gemm.w8a8_block_gemm(x, w, s, 128, 128))
