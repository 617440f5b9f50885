"""Expert biases and GPT-OSS's clamped SwiGLU in the fused MoE kernels (moe_infer/kernels/moe_epilogue.py): the
bf16 path (fused_moe.py) and the W4A16 path (fused_moe_w4a16.py) against a naive per-token loop written as
transformers' GptOssExperts computes (gate_up + bias, clamp, (up + 1) * glu, down + bias, times the routing
weight), and against the kernels' own references (fused_moe_ref.py, w4_ref.py).

CPU: the Triton interpreter at tiny shapes, float32. GPU (`-m gpu`): GPT-OSS-20B's expert shape in bf16.
"""
import dataclasses
import os

import pytest
import torch

from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig
from moe_infer.kernels.fused_moe_ref import fused_experts_ref
from moe_infer.kernels.moe_epilogue import Epilogue
from moe_infer.kernels.w4_format import dequantize_mxfp4, quantize_int4, quantize_mxfp4
from moe_infer.kernels.w4_ref import fused_moe_int4_ref, fused_moe_mxfp4_ref

pytestmark = pytest.mark.timeout(300)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = FusedMoEConfig(16, GemmConfig(16, 32), GemmConfig(16, 32))


def _kernels():
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CUDA or under TRITON_INTERPRET=1")
    from moe_infer.kernels import fused_moe, fused_moe_w4a16

    return fused_moe, fused_moe_w4a16


def gpt_oss_loop(x, ids, wts, w13, w2, b13, b2, alpha, limit, expert_start=0):
    """transformers' GptOssExperts, one (token, k) at a time in float64 (w13 rows: gate half, then up half)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    F = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - expert_start
            if int(ids[t, k]) < 0 or not 0 <= e < w13.shape[0]:
                continue
            h = w13[e].double().cpu() @ x[t].double().cpu() + b13[e].double().cpu()
            gate, up = h[:F].clamp(max=limit), h[F:].clamp(min=-limit, max=limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
            out[t] += float(wts[t, k]) * (w2[e].double().cpu() @ act + b2[e].double().cpu())
    return out


def _case(T, E, D, F, K, seed, dtype=torch.float32, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    w13 = torch.randn(E, 2 * F, D, generator=gen) * D ** -0.5 * 2
    w2 = torch.randn(E, D, F, generator=gen) * F ** -0.5
    b13 = torch.randn(E, 2 * F, generator=gen) * 0.5
    b2 = torch.randn(E, D, generator=gen) * 0.5
    wts, ids = torch.rand(T, E, generator=gen).topk(K, dim=1)
    wts = wts / wts.sum(1, keepdim=True)
    return [t.to(device) for t in (x.to(dtype), ids, wts)] + [w13, w2, b13.to(device, dtype), b2.to(device, dtype)]


def _rel(out, want):
    return float((out.double().cpu() - want).norm() / want.norm())


@pytest.mark.parametrize("T,config", [(1, None), (5, SMALL), (5, dataclasses.replace(SMALL, combine="tail")),
                                      (30, SMALL)])
def test_bf16_path_matches_gpt_oss_loop(T, config):
    """Clamp 0.6 (acts on these values), alpha 1.702; a dropped row, experts [1, 5) of 6 local."""
    fused_moe, _ = _kernels()
    x, ids, wts, w13, w2, b13, b2 = _case(T, 4, 48, 32, 2, seed=T)
    ids = ids + 1
    ids[0, 1] = -1
    epi = Epilogue(True, 1.702, 0.6, b13, b2)
    w13, w2 = w13.to(DEV), w2.to(DEV)
    h = torch.einsum("td,efd->tef", x.cpu(), w13.cpu())
    assert (h[..., :32] > 0.6).any() and (h[..., 32:].abs() > 0.6).any()  # the clamp acts on both sides
    out = fused_moe.fused_experts(x, ids, wts, w13, w2, 1, config, epilogue=epi)
    want = gpt_oss_loop(x, ids, wts, w13, w2, b13, b2, 1.702, 0.6, expert_start=1)
    assert _rel(out, want) < 1e-5
    assert _rel(fused_experts_ref(x, ids, wts, w13, w2, 1, epilogue=epi), want) < 1e-5
    plain = fused_moe.fused_experts(x, ids, wts, w13, w2, 1, config)
    assert _rel(plain, want) > 0.1  # the epilogue is not a no-op here


@pytest.mark.parametrize("part", ["bias_only", "clamp_only"])
def test_bf16_path_each_part_alone(part):
    """Biases with plain SiLU, and the clamp without biases: each switch on its own."""
    fused_moe, _ = _kernels()
    x, ids, wts, w13, w2, b13, b2 = _case(6, 4, 32, 16, 2, seed=4)
    w13, w2 = w13.to(DEV), w2.to(DEV)
    epi = Epilogue(False, b13_E2F=b13, b2_ED=b2) if part == "bias_only" else Epilogue(True, 1.702, 0.6)
    out = fused_moe.fused_experts(x, ids, wts, w13, w2, 0, SMALL, epilogue=epi)
    if part == "bias_only":
        F = 16
        want = torch.zeros(x.shape, dtype=torch.float64)
        for t in range(6):
            for k in range(2):
                e = int(ids[t, k])
                h = w13[e].double().cpu() @ x[t].double().cpu() + b13[e].double().cpu()
                act = torch.nn.functional.silu(h[:F]) * h[F:]
                want[t] += float(wts[t, k]) * (w2[e].double().cpu() @ act + b2[e].double().cpu())
    else:
        zeros13, zeros2 = torch.zeros_like(b13), torch.zeros_like(b2)
        want = gpt_oss_loop(x, ids, wts, w13, w2, zeros13, zeros2, 1.702, 0.6)
    assert _rel(out, want) < 1e-5


def _quantized(fmt, w):
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    packed, scale, _ = quantize_int4(w, 16, scale_dtype=torch.float32)
    return packed, scale


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("T,config", [(1, None), (7, SMALL)])
def test_w4a16_path_matches_gpt_oss_loop(fmt, T, config):
    """The 4-bit kernels with biases and the clamped SwiGLU: the loop over the dequantized weights."""
    _, w4 = _kernels()
    x, ids, wts, w13, w2, b13, b2 = _case(T, 4, 64, 32, 2, seed=10 + T)
    (p13, s13), (p2, s2) = _quantized(fmt, w13), _quantized(fmt, w2)
    if fmt == "mxfp4":
        d13, d2 = dequantize_mxfp4(p13, s13), dequantize_mxfp4(p2, s2)
    else:
        from moe_infer.kernels.w4_format import dequantize_int4
        d13, d2 = dequantize_int4(p13, s13, None, 16), dequantize_int4(p2, s2, None, 16)
    epi = Epilogue(True, 1.702, 0.6, b13, b2)
    p13, s13, p2, s2 = (t.to(DEV) for t in (p13, s13, p2, s2))
    if fmt == "mxfp4":
        out = w4.fused_moe_mxfp4(x, ids, wts, p13, s13, p2, s2, 0, config, epilogue=epi)
        ref = fused_moe_mxfp4_ref(x, ids, wts, p13, s13, p2, s2, 0, epilogue=epi)
    else:
        out = w4.fused_moe_int4(x, ids, wts, p13, s13, p2, s2, 16, config=config, epilogue=epi)
        ref = fused_moe_int4_ref(x, ids, wts, p13, s13, p2, s2, 16, epilogue=epi)
    want = gpt_oss_loop(x, ids, wts, d13, d2, b13, b2, 1.702, 0.6)
    assert _rel(out, want) < 1e-5 and _rel(ref, want) < 1e-5


def test_bad_bias_is_named():
    fused_moe, w4 = _kernels()
    x, ids, wts, w13, w2, b13, b2 = _case(2, 4, 32, 32, 2, seed=1)
    with pytest.raises(ValueError, match="b13_E2F must be"):
        fused_moe.fused_experts(x, ids, wts, w13.to(DEV), w2.to(DEV), epilogue=Epilogue(True, b13_E2F=b13[:, :32]))
    p13, s13 = quantize_mxfp4(w13)
    p2, s2 = quantize_mxfp4(w2)
    with pytest.raises(ValueError, match="b2_ED must be"):
        w4.fused_moe_mxfp4(x, ids, wts, p13.to(DEV), s13.to(DEV), p2.to(DEV), s2.to(DEV),
                           epilogue=Epilogue(True, b2_ED=b2[:3]))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["bf16", "mxfp4"])
@pytest.mark.parametrize("T", [1, 16, 300])
def test_gpu_gpt_oss_20b_shape(path, T):
    """GPT-OSS-20B's experts (E 32, K 4, D 2880, F 2880; limit 7.0) in bf16 on the GPU: within 1e-2 of the kernels'
    float32-sum reference per token (bf16 rounding of the activations and the intermediate)."""
    fused_moe, w4 = _kernels()
    x, ids, wts, w13, w2, b13, b2 = _case(T, 32, 2880, 2880, 4, seed=T, dtype=torch.bfloat16, device="cuda")
    epi = Epilogue(True, 1.702, 7.0, b13, b2)
    if path == "bf16":
        w13, w2 = w13.to("cuda", torch.bfloat16), w2.to("cuda", torch.bfloat16)
        out = fused_moe.fused_experts(x, ids, wts, w13, w2, epilogue=epi)
        ref = fused_experts_ref(x, ids, wts, w13, w2, epilogue=epi)
    else:
        (p13, s13), (p2, s2) = [quantize_mxfp4(w.cuda()) for w in (w13, w2)]  # on the GPU: no host peak
        out = w4.fused_moe_mxfp4(x, ids, wts, p13, s13, p2, s2, epilogue=epi)
        ref = fused_moe_mxfp4_ref(x, ids, wts, p13, s13, p2, s2, epilogue=epi)
    err = (out.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1)
    assert (err <= 1e-2).all(), f"worst token {err.max():.3g}"
