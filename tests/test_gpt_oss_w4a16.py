"""GPT-OSS's experts in the fused kernels: the mxfp4 experts (the one `Mxfp4` format, moe_infer/quant_w4.py, that the
loader builds from a GPT-OSS checkpoint) run the W4A16 Triton kernel and bf16 / float32 ones the fused MoE kernel,
both with the gate/up and down biases and the clamped SwiGLU in their epilogues (moe_infer/kernels/moe_epilogue.py).
Checked against transformers: a naive loop over its experts' own parameters (gate and up interleaved, biases, the
clamp) for one layer, and its generate through the engine, with the fused kernel counted and the reference loop
forbidden.

CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1 without a GPU); with a GPU the model runs on it.
"""
import pytest
import torch

import moe_infer.experts.triton_experts as triton_experts
from moe_infer.models import load_model
from test_gpt_oss import _mxfp4_checkpoint

pytestmark = pytest.mark.timeout(600)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _hf_gpt_oss_experts(hf, layer, x_TD, ids_TK, wts_TK):
    """transformers' GptOssExperts on its own parameters: gate_up [E, D, 2F] with gate and up columns alternating
    (bias likewise), clamp, (up + 1) * gate * sigmoid(alpha * gate), down [E, F, D] + bias, times the routing weight;
    a loop over tokens and their experts."""
    ex = hf.model.layers[layer].mlp.experts
    gate_up, down = ex.gate_up_proj.detach().float(), ex.down_proj.detach().float()
    b_gu, b_d = ex.gate_up_proj_bias.detach().float(), ex.down_proj_bias.detach().float()
    y = torch.zeros_like(x_TD, dtype=torch.float32)
    for t in range(x_TD.shape[0]):
        for e, w in zip(ids_TK[t].tolist(), wts_TK[t].tolist()):
            h = x_TD[t].float() @ gate_up[e] + b_gu[e]
            gate, up = h[0::2].clamp(max=ex.limit), h[1::2].clamp(min=-ex.limit, max=ex.limit)
            y[t] += w * (((up + 1) * gate * torch.sigmoid(gate * ex.alpha)) @ down[e] + b_d[e])
    return y


def _count(monkeypatch, module, name, calls):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or real(*a, **k))


def _forbid_the_loop(monkeypatch):
    def loop(*a, **k):
        raise AssertionError("GPT-OSS experts ran the reference loop, not the fused kernel")
    monkeypatch.setattr(triton_experts, "experts_torch", loop)


def test_gpt_oss_mxfp4_layer_runs_the_w4a16_kernel(tmp_path, monkeypatch):
    """One GPT-OSS layer's mxfp4 experts with biases and the clamped SwiGLU (limit 2.0, which acts on these weights)
    through the MoE layer's fused path: the W4A16 kernel runs, and its output equals transformers' experts on the
    same bytes dequantized by transformers."""
    from moe_infer.kernels import fused_moe_w4a16
    from moe_infer.layers.moe import MoEBackends

    path, hf = _mxfp4_checkpoint(tmp_path)
    model = load_model(path, torch.float32, DEVICE, backends=MoEBackends(experts="triton"))
    mlp = model.layers[1].mlp
    assert mlp.store.w13_E2FD.quant.fmt == "mxfp4" and mlp.expert_bias and mlp.can_fuse_experts
    calls = []
    _count(monkeypatch, fused_moe_w4a16, "fused_moe_mxfp4", calls)
    _forbid_the_loop(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    T, E, K, D = 6, model.arch.num_experts, model.arch.top_k, model.arch.hidden_size
    x_TD = torch.randn(T, D, generator=gen) * 2
    wts_TK, ids_TK = torch.rand(T, E, generator=gen).topk(K, dim=1)
    wts_TK = wts_TK / wts_TK.sum(1, keepdim=True)
    with torch.no_grad():
        out = mlp._routed_experts(x_TD.to(DEVICE), ids_TK.to(DEVICE), wts_TK.to(DEVICE)).cpu()
    assert calls == ["fused_moe_mxfp4"]
    ref = _hf_gpt_oss_experts(hf, 1, x_TD, ids_TK, wts_TK)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(out.float(), ref, atol=1e-4 * float(ref.abs().max()), rtol=1e-4)


@pytest.mark.parametrize("fmt", ["mxfp4", "float32", "mxfp4_offloaded"])
def test_gpt_oss_engine_runs_the_fused_kernels(fmt, tmp_path, monkeypatch):
    """Through the engine (chunked prefill, decode) with the triton experts backend: greedy tokens equal to
    transformers' generate; every MoE layer call ran the fused kernel (W4A16 for the mxfp4 checkpoint, the bf16 path's
    for the float32 one), none the reference loop. Offloaded: the W4A16 kernel on the 2-slot pool and the stream
    buffers, the slots' biases in its epilogue."""
    from transformers import GenerationConfig

    from moe_infer import LLM, SamplingParams
    from moe_infer.kernels import fused_moe_w4a16
    from tiny_hf import load_hf_model, make_tiny_checkpoint

    if fmt.startswith("mxfp4"):
        path, hf = _mxfp4_checkpoint(tmp_path, seed=5)
    else:
        path = make_tiny_checkpoint("gpt_oss", tmp_path / "f32", seed=5)
        hf = load_hf_model(path)
    prompts = [list(range(40, 53)), [11, 12, 13, 14]]
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = [hf.generate(torch.tensor([p]), generation_config=gc)[0, len(p):].tolist() for p in prompts]
    calls = []
    if fmt.startswith("mxfp4"):
        real = fused_moe_w4a16.fused_moe_mxfp4

        def counted(x, ids, w, w13, *a, epilogue=None, **k):
            calls.append((w13.shape[0], epilogue is not None and epilogue.b13_E2F is not None and epilogue.clamped))
            return real(x, ids, w, w13, *a, epilogue=epilogue, **k)
        monkeypatch.setattr(fused_moe_w4a16, "fused_moe_mxfp4", counted)
    else:
        _count(monkeypatch, triton_experts, "fused_experts", calls)
    _forbid_the_loop(monkeypatch)
    offload = dict(offload="cpu", slots_per_layer=2, miss_policy="wait") if fmt == "mxfp4_offloaded" else {}
    llm = LLM(model=path, dtype="float32", device=DEVICE, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
              experts_backend="triton", **offload)
    assert offload or all(layer.can_fuse_experts for layer in llm.engine.runner.model.moe_layers())
    calls.clear()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert len(calls) >= 2 * len(llm.engine.runner.model.moe_layers())  # a prefill and a decode at least
    if fmt.startswith("mxfp4"):
        assert all(with_extras for _, with_extras in calls)
    if offload:
        assert 2 in {n for n, _ in calls}  # the slot pool


def test_gpt_oss_quantized_at_load_to_int4_runs_the_w4a16_kernel(tmp_path, monkeypatch):
    """quantization="int4" on a float32 GPT-OSS checkpoint: int4 experts with biases and the clamped SwiGLU through
    the W4A16 kernel with its epilogue give the tokens of the PyTorch experts backend's loop on the same weights."""
    from moe_infer import LLM, SamplingParams
    from moe_infer.kernels import fused_moe_w4a16
    from tiny_hf import make_tiny_checkpoint

    path = make_tiny_checkpoint("gpt_oss", tmp_path / "f32", seed=5)
    prompts = [{"prompt_token_ids": p} for p in (list(range(40, 53)), [11, 12, 13, 14])]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    kw = dict(model=path, dtype="float32", device=DEVICE, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
              quantization="int4")
    want = [o.outputs[0].token_ids for o in LLM(**kw, experts_backend="torch").generate(prompts, params,
                                                                                        use_tqdm=False)]
    calls = []
    _count(monkeypatch, fused_moe_w4a16, "fused_moe_int4", calls)
    _forbid_the_loop(monkeypatch)
    llm = LLM(**kw, experts_backend="triton")
    assert llm.engine.runner.model.moe_layers()[0].store.w13_E2FD.quant.fmt == "int4"
    calls.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert len(calls) >= 2 * len(llm.engine.runner.model.moe_layers())
