"""GPT-OSS's mxfp4 experts and the W4A16 kernel: the one `Mxfp4` format (moe_infer/quant.py) that the loader builds
from a GPT-OSS checkpoint is what `fused_experts_any` hands to the W4A16 Triton kernel. The experts of GPT-OSS itself
carry biases and a clamped SwiGLU, which the kernel does not apply, so those layers stay on the reference loop
(`can_fuse_experts` False); the same loaded weights as plain SwiGLU experts without biases run the kernel, checked
against transformers' own dequantization of the checkpoint's bytes (a naive loop here, in HF's layout).

CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1 without a GPU); with a GPU the model runs on it.
"""
import pytest
import torch

import moe_infer.experts.triton_experts  # noqa: F401  (registers EXPERT_BACKENDS["triton"])
from moe_infer.models import load_model
from test_gpt_oss import _mxfp4_checkpoint

pytestmark = pytest.mark.timeout(600)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _hf_swiglu_experts(hf, layer, x_TD, ids_TK, wts_TK):
    """Plain SwiGLU experts without biases on the HF model's (dequantized) weights: gate_up [E, D, 2F] with gate and
    up columns alternating, down [E, F, D]; a loop over tokens and their experts."""
    experts = hf.model.layers[layer].mlp.experts
    gate_up, down = experts.gate_up_proj.detach().float(), experts.down_proj.detach().float()
    y = torch.zeros_like(x_TD, dtype=torch.float32)
    for t in range(x_TD.shape[0]):
        for e, w in zip(ids_TK[t].tolist(), wts_TK[t].tolist()):
            h = x_TD[t].float() @ gate_up[e]
            y[t] += w * ((torch.nn.functional.silu(h[0::2]) * h[1::2]) @ down[e])
    return y


def test_gpt_oss_layers_with_biases_stay_on_the_loop(tmp_path):
    """GPT-OSS's experts (biases, clamped SwiGLU): mxfp4-formatted, but not fused; the triton backend runs its
    reference loop with the extras."""
    from moe_infer.layers.moe import MoEBackends

    path, _ = _mxfp4_checkpoint(tmp_path)
    model = load_model(path, torch.float32, "cpu", backends=MoEBackends(experts="triton"))
    mlp = model.layers[0].mlp
    assert mlp.store.w13_E2FD.quant.fmt == "mxfp4" and mlp.store.w2_EDF.quant.fmt == "mxfp4"
    assert mlp.expert_bias and not mlp.can_fuse_experts


def test_gpt_oss_mxfp4_experts_reach_the_w4a16_kernel(tmp_path, monkeypatch):
    """The loaded GPT-OSS experts' Mxfp4 weights, taken as plain SwiGLU experts without biases, run the W4A16
    kernel through the MoE layer's fused path; its output equals the naive loop over transformers' dequantized
    weights."""
    from moe_infer.experts.activation import SILU
    from moe_infer.kernels import fused_moe_w4a16
    from moe_infer.layers.moe import MoEBackends

    path, hf = _mxfp4_checkpoint(tmp_path)
    model = load_model(path, torch.float32, DEVICE, backends=MoEBackends(experts="triton"))
    mlp = model.layers[1].mlp
    mlp.expert_bias, mlp.expert_act = False, SILU  # what the kernel computes: SwiGLU, no biases
    assert mlp.can_fuse_experts
    calls = []
    kernel = fused_moe_w4a16.fused_moe_mxfp4
    monkeypatch.setattr(fused_moe_w4a16, "fused_moe_mxfp4", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    gen = torch.Generator().manual_seed(0)
    T, E, K, D = 5, model.arch.num_experts, model.arch.top_k, model.arch.hidden_size
    x_TD = torch.randn(T, D, generator=gen)
    wts_TK, ids_TK = torch.rand(T, E, generator=gen).topk(K, dim=1)
    wts_TK = wts_TK / wts_TK.sum(1, keepdim=True)
    with torch.no_grad():
        out = mlp._routed_experts(x_TD.to(DEVICE), ids_TK.to(DEVICE), wts_TK.to(DEVICE)).cpu()
    assert calls, "the mxfp4 experts did not reach the W4A16 kernel"
    ref = _hf_swiglu_experts(hf, 1, x_TD, ids_TK, wts_TK)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(out.float(), ref, atol=1e-4 * float(ref.abs().max()), rtol=1e-4)
