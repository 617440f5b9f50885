"""W4A16 fused MoE (fused_moe_w4a16.py) against its PyTorch reference (w4_ref.py), and the 4-bit formats
(w4_format.py) against independent checks: the packing against a loop over bits, the e2m1 table against the OCP
formula, the quantizers' round-trip error against half a quantization step.

CPU: the Triton interpreter at tiny shapes (float32 dots on the dequantized values). GPU (`-m gpu`): Qwen3-30B-A3B's
expert shape in bf16.
"""
import os

import pytest
import torch

from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig
from moe_infer.kernels.w4_format import (
    E2M1_VALUES, dequantize_int4, dequantize_mxfp4, pack_int4, quantize_int4, quantize_mxfp4, unpack_int4,
)
from moe_infer.kernels.w4_ref import fused_moe_int4_ref, fused_moe_mxfp4_ref

pytestmark = pytest.mark.timeout(300)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
BF16_ULP = 2.0 ** -7


def _kernel():
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CUDA or under TRITON_INTERPRET=1")
    from moe_infer.kernels import fused_moe_w4a16

    return fused_moe_w4a16


# ---- formats against independent checks -------------------------------------------------------------------

def test_int4_packing_against_a_loop_over_bits():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 16), generator=gen, dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, 2)
    for idx in [(0, 0, 0), (1, 3, 1), (2, 4, 0), (2, 4, 1)]:
        word = sum(int(codes[idx[0], idx[1], idx[2] * 8 + j]) << (4 * j) for j in range(8))
        assert int(packed[idx]) & 0xFFFFFFFF == word  # value j at bits 4j (compressed-tensors' order)
    assert torch.equal(unpack_int4(packed), codes)


def test_e2m1_table_is_the_ocp_formula():
    """(-1)^s * 2^(e - 1) * (1 + m / 2) for e > 0, (-1)^s * m / 2 for e = 0 (bias 1, one mantissa bit)."""
    for code in range(16):
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        want = (-1) ** s * (2.0 ** (e - 1) * (1 + m / 2) if e else m / 2)
        assert E2M1_VALUES[code] == want
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)  # low nibble first: codes 1, 2, 8, 15
    scale = torch.tensor([[128]], dtype=torch.uint8).expand(1, 1)  # 2^1
    w = dequantize_mxfp4(torch.cat([packed, torch.zeros(1, 14, dtype=torch.uint8)], 1), scale)
    assert w[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_round_trip_within_half_a_step(group, symmetric):
    gen = torch.Generator().manual_seed(group)
    w = torch.randn(6, 256, generator=gen) * torch.logspace(-3, 1, 256)  # groups of very different sizes
    w[1, :group] = 0.0
    packed, scale, zero = quantize_int4(w, group, symmetric, torch.float32)
    assert (zero is None) == symmetric and scale.shape == (6, 256 // group)
    deq = dequantize_int4(packed, scale, zero, group)
    step = scale.repeat_interleave(group, 1)
    assert ((deq - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert (deq[1, :group] == 0).all()
    if symmetric:  # the largest |w| of each group is +-7 steps, so the half-step bound is tight somewhere
        assert ((deq - w).abs() / step).max() > 0.3


def test_mxfp4_round_trip_and_exact_values():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4, 128, generator=gen) * torch.logspace(-4, 2, 128)
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 64) and scale.shape == (4, 4)
    deq = dequantize_mxfp4(packed, scale)
    unit = torch.exp2(scale.float() - 127).repeat_interleave(32, 1)
    v = w / unit  # in units of the shared scale: |v| < 8
    # half an e2m1 step is <= |v| / 4 in [1, 6], 0.25 below 1; saturation at 6 of v < 8 also within |v| / 4
    assert ((deq - w).abs() <= unit * torch.clamp(v.abs() / 4, min=0.25) * (1 + 1e-6)).all()
    exact = torch.tensor(E2M1_VALUES * 2).reshape(1, 32) * 0.125  # every e2m1 value, scale 2^-3 (amax 6 -> 2^(2-2))
    p, s = quantize_mxfp4(exact)
    assert torch.equal(dequantize_mxfp4(p, s), exact) and int(s) == 127 - 3
    ties = torch.tensor([[0.75, 1.75, 3.5, 2.5, 0.25, 5.0] + [0.0] * 25 + [6.0]])  # OCP: ties to the even code
    assert dequantize_mxfp4(*quantize_mxfp4(ties))[0, :6].tolist() == [1.0, 2.0, 4.0, 2.0, 0.0, 4.0]


# ---- kernel against the reference ---------------------------------------------------------------------------

def _weights(gen, fmt, E, N, K, group, zero, device):
    w = torch.randn(E, N, K, generator=gen) / K ** 0.5
    if fmt == "mxfp4":
        return [t.to(device) for t in quantize_mxfp4(w)] + [None]
    packed, scale, z = quantize_int4(w, group, symmetric=not zero, scale_dtype=torch.bfloat16)
    return [packed.to(device), scale.to(device), None if z is None else z.to(device)]


def _case(fmt, T, dtype, group=32, zero=False, E=4, D=64, F=32, K=2, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed + T)
    x = torch.randn(T, D, generator=gen).to(device, dtype)
    w13 = _weights(gen, fmt, E, 2 * F, D, group, zero, device)
    w2 = _weights(gen, fmt, E, D, F, group, zero, device)
    wts, ids = torch.rand(T, E, generator=gen).topk(K, dim=1)
    return x, ids.to(device), (wts / wts.sum(1, keepdim=True)).to(device), w13, w2


def _run(fm, fmt, case, group, expert_start=0, config=None):
    x, ids, wts, (p13, s13, z13), (p2, s2, z2) = case
    if fmt == "mxfp4":
        return (fm.fused_moe_mxfp4(x, ids, wts, p13, s13, p2, s2, expert_start, config),
                fused_moe_mxfp4_ref(x, ids, wts, p13, s13, p2, s2, expert_start))
    return (fm.fused_moe_int4(x, ids, wts, p13, s13, p2, s2, group, z13, z2, expert_start, config),
            fused_moe_int4_ref(x, ids, wts, p13, s13, p2, s2, group, z13, z2, expert_start))


SMALL = FusedMoEConfig(16, GemmConfig(16, 32), GemmConfig(16, 32))


def _assert_close(out, ref, dtype):
    """float32 order (1e-5 of the largest output); bf16: the intermediate's rounding too (a few output units)."""
    tol = 1e-5 * ref.float().abs().max() if dtype == torch.float32 else 4 * BF16_ULP * ref.float().abs().max()
    diff = (out.float() - ref.float()).abs()
    assert (diff <= tol).all(), f"max diff {diff.max():.3g} > {tol:.3g}"


@pytest.mark.parametrize("fmt,group,zero", [("int4", 32, False), ("int4", 16, True), ("mxfp4", 32, False)])
@pytest.mark.parametrize("T,config", [(1, None), (3, SMALL), (40, SMALL)])
def test_kernel_matches_ref(fmt, group, zero, T, config):
    """T 1: the inline decode schedule, the default tiles (BLOCK_K past D); T 40 (80 rows): several tiles an
    expert, the align schedule; dropped (-1) rows; a token with both rows dropped gives zeros."""
    fm = _kernel()
    case = _case(fmt, T, torch.float32, group, zero)
    if T >= 3:
        case[1][1, 0] = -1
        case[1][2, :] = -1
    out, ref = _run(fm, fmt, case, group, config=config)
    assert out.shape == case[0].shape and ref.abs().max() > 0.05
    if T >= 3:
        assert (out[2] == 0).all()
    _assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_kernel_bf16_and_local_experts(fmt):
    """bf16 activations; experts [2, 6) of 8 local to this call: rows routed elsewhere add nothing."""
    fm = _kernel()
    case = list(_case(fmt, 6, torch.bfloat16, E=4, seed=3))
    case[1] = torch.tensor([[2, 5], [0, 3], [7, 6], [4, 1], [2, 2], [5, 3]], device=DEVICE)
    out, ref = _run(fm, fmt, case, 32, expert_start=2, config=SMALL)
    assert out.dtype == torch.bfloat16 and (out[2] == 0).all() and out[1].abs().max() > 0
    _assert_close(out, ref, torch.bfloat16)


def test_kernel_rejects_bad_inputs():
    fm = _kernel()
    x, ids, wts, (p13, s13, _), (p2, s2, _) = _case("int4", 2, torch.float32)
    with pytest.raises(ValueError, match="w13's scale"):
        fm.fused_moe_int4(x, ids, wts, p13, s13[:, :, :1], p2, s2, 32)
    with pytest.raises(ValueError, match="must be torch.int32"):
        fm.fused_moe_int4(x, ids, wts, p13.to(torch.uint8), s13, p2, s2, 32)
    with pytest.raises(ValueError, match="group 48 must divide"):
        fm.fused_moe_int4(x, ids, wts, p13, s13, p2, s2, 48)
    with pytest.raises(ValueError, match="disagree"):
        fm.fused_moe_int4(x, ids[:1], wts, p13, s13, p2, s2, 32)
    with pytest.raises(ValueError, match="unknown 4-bit format"):
        fm.fused_moe_w4a16(x, ids, wts, "nf4", p13, s13, p2, s2, 32)


# ---- GPU: Qwen3-30B-A3B experts (D 2048, F 768, E 128, K 8), bf16 -------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", 32), ("mxfp4", 32)])
@pytest.mark.parametrize("T", [1, 16, 256])
def test_gpu_kernel_matches_ref(fmt, group, T):
    """Each token within 1e-2 of the reference (relative 2-norm): bf16 rounding of the intermediate and of the
    dequantized weights in another order."""
    fm = _kernel()
    case = _case(fmt, T, torch.bfloat16, group, E=128, D=2048, F=768, K=8, device="cuda")
    out, ref = _run(fm, fmt, case, group)
    err = (out.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1)
    assert (err <= 1e-2).all(), f"worst token {err.max():.3g}"


@pytest.mark.gpu
def test_gpu_kernel_captures_in_a_cuda_graph():
    fm = _kernel()
    case = _case("int4", 8, torch.bfloat16, 128, E=16, D=1024, F=256, K=4, device="cuda")
    x, ids, wts, (p13, s13, _), (p2, s2, _) = case
    fm.fused_moe_int4(x, ids, wts, p13, s13, p2, s2, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe_int4(x, ids, wts, p13, s13, p2, s2, 128)
    new = _case("int4", 8, torch.bfloat16, 128, E=16, D=1024, F=256, K=4, seed=9, device="cuda")
    for buf, src in zip((x, ids, wts), new[:3]):
        buf.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fm.fused_moe_int4(x, ids, wts, p13, s13, p2, s2, 128))


@pytest.mark.parametrize("fmt,group,zero", [("int4", 32, False), ("int4", 16, True), ("mxfp4", 32, False)])
@pytest.mark.parametrize("M", [0, 1, 20])
def test_dense_gemm_matches_dequantized_matmul(fmt, group, zero, M):
    """The dense-layer W4A16 GEMM against x @ w^T on the weight dequantized by w4_format (N 40: a partial tile)."""
    fm = _kernel()
    gen = torch.Generator().manual_seed(M)
    p, s, z = _weights(gen, fmt, 1, 40, 96, group, zero, DEVICE)
    x = torch.randn(M, 96, generator=gen).to(DEVICE)
    y = fm.w4a16_gemm(x, p[0], s[0], group if fmt == "int4" else 32, None if z is None else z[0], fmt)
    w = (dequantize_int4(p[0], s[0], None if z is None else z[0], group) if fmt == "int4"
         else dequantize_mxfp4(p[0], s[0]))
    assert y.shape == (M, 40)
    torch.testing.assert_close(y, x @ w.T, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_int4_dense_layer_runs_the_w4a16_gemm():
    """A dense int4 layer on CUDA goes through W4_LINEAR_KERNELS (not the dequantizing fallback), at decode and
    prefill row counts, within bf16 rounding of x @ w^T on the dequantized weight."""
    from moe_infer.layers.linear import linear
    from moe_infer.plugins import load_plugins
    from moe_infer.quant import W4_LINEAR_KERNELS, QuantSpec, make_linear

    load_plugins()
    with torch.device("cuda"):  # built on the device, as the engine builds its model (scales are the format's)
        layer = make_linear(2048, 4096, False, torch.bfloat16, QuantSpec("int4", group_size=128))
    w = torch.randn(4096, 2048, device="cuda") / 2048 ** 0.5
    layer.weight.quant.store(layer.weight, (slice(None),), w)
    calls, real = [], W4_LINEAR_KERNELS.get("triton")
    W4_LINEAR_KERNELS._entries["triton"] = lambda *a: calls.append(1) or real(*a)
    try:
        for M in (1, 16, 512):
            x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
            y = linear(x, layer.weight)
            want = x.float() @ layer.weight.quant.dequantize(layer.weight).T
            assert ((y.float() - want).norm() / want.norm()) < 1e-2
    finally:
        W4_LINEAR_KERNELS._entries["triton"] = real
    assert len(calls) == 3
