"""GPT-OSS specifics beside the parity tests (test_models_parity.py, test_engine_parity.py): the family's config
(alternating windows, sinks, biases, clamped SwiGLU), the SDPA and Triton attention paths with sinks, and mxfp4
experts: a tiny checkpoint written with this test's own e2m1/e8m0 packing, checked against transformers' model
whose experts hold transformers' own dequantization of the same bytes.
"""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_infer.models import arch_from_config, load_arch, load_model
from paged_sim import PagedSim, run_schedule
from parity_cases import SCHEDULE, hf_logits, make_tokens
from tiny_hf import edit_config, load_hf_model, make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)


def test_release_config_reads_as_the_family():
    """gpt-oss-20b's config (transformers' defaults): sliding (128) and full layers alternating from the first,
    sinks, biases, the clamped SwiGLU, YaRN."""
    from transformers import GptOssConfig

    arch = arch_from_config(GptOssConfig(architectures=["GptOssForCausalLM"], num_hidden_layers=24,
                                         num_local_experts=32))
    assert arch.family == "gpt_oss" and arch.num_layers == 24 and arch.moe_layer_ids == list(range(24))
    assert arch.sliding_windows == (128, None) * 12
    assert arch.attn_sinks and arch.router_bias and arch.expert_bias and arch.qkv_bias and arch.o_bias
    assert (arch.expert_act.kind, arch.expert_act.alpha, arch.expert_act.limit) == ("clamped_swiglu", 1.702, 7.0)
    assert arch.rope_parameters["rope_type"] == "yarn" and arch.top_k == 4 and arch.norm_topk_prob


@pytest.mark.parametrize("fields,match", [
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
])
def test_bad_layer_configs_are_refused(tmp_path, fields, match):
    path = make_tiny_checkpoint("gpt_oss", tmp_path / "g", seed=0)
    edit_config(path, **fields)
    with pytest.raises(ValueError, match=match):
        load_arch(path)


OFFLOAD_CASES = {
    "cpu_wait": dict(offload="cpu", slots_per_layer=2, miss_policy="wait"),
    "cpu_misses_on_host": dict(offload="cpu", slots_per_layer=1, miss_policy="cpu", prefetch=False),
    "cpu_share_to_whole": dict(offload="cpu", slots_per_layer=2, miss_policy="share"),
    "nvme": dict(offload="nvme", nvme_reader="threads", slots_per_layer=2, miss_policy="auto"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(OFFLOAD_CASES))
@pytest.mark.parametrize("fmt", ["mxfp4", "float32"])
def test_offloaded_experts_equal_resident(fmt, case, tmp_path):
    """GPT-OSS's experts offloaded (mxfp4 as the release stores them, or float32): every tier and slot holds each
    expert's gate/up and down biases beside its weights (moved with them), the device computes the slots with the
    clamped SwiGLU and the slots' biases, the host a missed expert with its own; the resident engine's tokens."""
    from moe_infer import LLM, SamplingParams

    if fmt == "mxfp4":
        path, _ = _mxfp4_checkpoint(tmp_path, seed=5)
    else:
        path = make_tiny_checkpoint("gpt_oss", tmp_path / "f32", seed=5)
    kw = dict(model=path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    prompts = [{"prompt_token_ids": p} for p in (list(range(40, 53)), [11, 12, 13, 14], [7, 7, 8, 8, 9, 9, 10])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    offload = dict(OFFLOAD_CASES[case], **({"nvme_path": str(tmp_path)} if case == "nvme" else {}))
    llm = LLM(**kw, **offload)
    store = llm.engine.runner.model.moe_layers()[0].store
    F, D = store.manager.shape.intermediate_size, store.manager.shape.hidden_size
    assert (store.slots["b13"].shape[1:], store.slots["b2"].shape[1:]) == ((2 * F,), (D,))
    assert store.w13_S2FD.expert_bias is store.slots["b13"] and store.w2_SDF.expert_bias is store.slots["b2"]
    assert (fmt == "mxfp4") == (store.w13_S2FD.dtype == torch.uint8)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    total = llm.get_offload_stats()["total"]
    if case == "cpu_misses_on_host":
        assert total["cpu"] == total["needed"] > 0, str(total)
    else:
        assert total["needed"] > total["hits"] > 0 and total["shared"] == 0, str(total)
    llm.shutdown()


def test_sdpa_backend_with_sinks_matches_the_reference(tmp_path):
    path = make_tiny_checkpoint("gpt_oss", tmp_path / "g", seed=4)
    ours = load_model(path, torch.float32, "cpu", attn_backend="sdpa")
    ref = load_model(path, torch.float32, "cpu", attn_backend="torch")
    tokens = make_tokens(ours.arch.vocab_size, seed=6)
    a = run_schedule(PagedSim(ours, block_size=4, num_blocks=32), tokens, SCHEDULE)
    b = run_schedule(PagedSim(ref, block_size=4, num_blocks=32), tokens, SCHEDULE)
    for s in tokens:
        torch.testing.assert_close(a[s], b[s], atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(600)  # the interpreter runs every attention call of the engine
def test_triton_attention_in_the_engine_interpreter():
    """The paged Triton kernels with sinks and windows in the engine on CPU (interpreter): chunked prefill (prompt
    chunks over earlier chunks, sliding layers reading only their window) and decode steps through the one-kernel
    rope decode attention (head_dim 16); transformers' first tokens."""
    pytest.importorskip("moe_infer.layers.attention_triton")
    if torch.cuda.is_available():
        pytest.skip("tests/test_engine_parity.py's CUDA variants run it on the GPU")
    from engine_fixtures import checkpoint, hf_greedy
    from moe_infer import LLM, SamplingParams

    path = checkpoint("gpt_oss")
    prompts = [list(range(40, 61)), [11, 12, 13]]
    num_new = 5
    ref = [hf_greedy(path, p, num_new)[0] for p in prompts]
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, attention_backend="triton",
              num_kv_blocks=64, max_num_batched_tokens=8, enable_prefix_caching=False)
    attn = llm.engine.runner.model.layers[0].self_attn
    assert attn.decode_in_one_call and attn.sinks is not None and attn.sliding_window == 5
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_chunked_prefills > 0
    assert [o.outputs[0].token_ids for o in outs] == ref


# ---- mxfp4 -------------------------------------------------------------------------------------------------------

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitudes of codes 0..7; bit 3 the sign


def _pack_mxfp4(w_NK: torch.Tensor):
    """This test's own mxfp4 quantizer: per 32 values along K the power of two 2^e with amax <= 6 * 2^e, each value
    rounded to the nearest e2m1 magnitude; -> (blocks [..., N, K/32, 16] uint8, scales [..., N, K/32] uint8)."""
    *lead, N, K = w_NK.shape
    g = w_NK.float().reshape(*lead, N, K // 32, 32)
    amax = g.abs().amax(-1).clamp_min(2.0 ** -100)
    e = torch.ceil(torch.log2(amax / 6.0))
    x = g / torch.exp2(e)[..., None]
    code = (x.abs()[..., None] - _E2M1).abs().argmin(-1) + 8 * (x < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (e + 127).to(torch.uint8).contiguous()


def _mxfp4_checkpoint(tmp_path, seed=3):
    """A tiny GPT-OSS checkpoint whose experts are stored as transformers' mxfp4 checkpoints store them, and the
    HF model whose experts hold transformers' dequantization of those bytes (the oracle)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = make_tiny_checkpoint("gpt_oss", tmp_path / "mx", seed=seed)
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    hf = load_hf_model(path)
    for name in [n for n in sd if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        w = sd.pop(name)  # HF's [E, in, out]: quantized along `in`, rows of `out` (gate_up: gate, up alternate)
        blocks, scales = _pack_mxfp4(w.transpose(1, 2))
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
        deq = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert deq.shape == w.shape and (deq - w).abs().max() < 0.3 * w.abs().max()  # a coarse copy of w
        hf.get_parameter(name).data.copy_(deq)
    save_file(sd, file, metadata={"format": "pt"})
    edit_config(path, quantization_config={
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"]})
    return path, hf


def test_mxfp4_dequantize_matches_transformers():
    """quant.mxfp4_dequantize (the kernels' reference) against transformers' dequantizer, every byte and scale."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moe_infer.quant import mxfp4_dequantize

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code in both nibbles
    scales = torch.randint(100, 150, (3, 10, 4), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, N, K]
    ours = mxfp4_dequantize(blocks.flatten(-2), scales)
    assert torch.equal(ours, theirs)


def test_mxfp4_checkpoint_matches_transformers(tmp_path):
    """Experts stay packed (uint8 codes + uint8 scales, never a bf16 copy); logits of prefill chunks and decodes
    equal transformers' on the dequantized weights."""
    path, hf = _mxfp4_checkpoint(tmp_path)
    model = load_model(path, torch.float32, "cpu")
    assert model.arch.quant.method == "mxfp4"
    store = model.layers[0].mlp.store
    E, F, D = model.arch.num_experts, model.arch.moe_intermediate_size, model.arch.hidden_size
    assert store.w13_E2FD.dtype == torch.uint8 and tuple(store.w13_E2FD.shape) == (E, 2 * F, D // 2)
    assert tuple(store.w13_E2FD_scales.shape) == (E, 2 * F, D // 32) and tuple(store.w2_EDF.shape) == (E, D, F // 2)
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # attention stays unquantized
    tokens = make_tokens(model.arch.vocab_size, seed=1)
    ours = run_schedule(PagedSim(model, block_size=4, num_blocks=32, seed=2), tokens, SCHEDULE)
    ref = hf_logits(hf, tokens)
    for s in tokens:
        assert ref[s].std() > 0.5
        torch.testing.assert_close(ours[s], ref[s], atol=1e-4, rtol=1e-4)


def test_mxfp4_engine_greedy_matches_transformers(tmp_path):
    """Through the engine (chunked prefill, bf16 dense layers' counterpart in float32 here): greedy tokens equal to
    transformers' generate on the dequantized experts."""
    from transformers import GenerationConfig

    from moe_infer import LLM, SamplingParams

    path, hf = _mxfp4_checkpoint(tmp_path, seed=5)
    prompts = [list(range(40, 61)), [11, 12, 13, 14]]
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = [hf.generate(torch.tensor([p]), generation_config=gc)[0, len(p):].tolist() for p in prompts]
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_mxfp4_dummy_weights(tmp_path):
    """load_format=dummy on an mxfp4 config: packed random codes with a power-of-two scale that brings the values to
    about +-1/sqrt(K), finite logits."""
    from moe_infer.quant import mxfp4_dequantize

    path, _ = _mxfp4_checkpoint(tmp_path)
    model = load_model(path, torch.bfloat16, "cpu", load_format="dummy")
    store = model.layers[1].mlp.store
    w = mxfp4_dequantize(store.w13_E2FD, store.w13_E2FD_scales)
    K = w.shape[-1]
    assert 0.2 * K ** -0.5 < w.std() < 2 * K ** -0.5
    assert len(torch.unique(store.w13_E2FD)) > 200  # random codes, not a constant
    tokens = make_tokens(model.arch.vocab_size, seed=1)
    out = run_schedule(PagedSim(model, block_size=4, num_blocks=32), tokens, SCHEDULE)
    assert all(torch.isfinite(v).all() for v in out.values())


@pytest.mark.gpu
@pytest.mark.timeout(600)  # the first GPU test of a process JIT-compiles the Triton kernels
def test_mxfp4_engine_greedy_matches_transformers_cuda(tmp_path):
    """The engine on CUDA (Triton attention with sinks and windows, the experts in the W4A16 kernel with their biases
    and clamped SwiGLU, CUDA graphs of decode steps): greedy tokens of transformers' generate on the dequantized
    experts (float32)."""
    from transformers import GenerationConfig

    from moe_infer import LLM, SamplingParams

    path, hf = _mxfp4_checkpoint(tmp_path, seed=5)
    prompts = [list(range(40, 61)), [11, 12, 13, 14], list(range(3, 40))]
    gc = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = [hf.generate(torch.tensor([p]), generation_config=gc)[0, len(p):].tolist() for p in prompts]
    llm = LLM(model=path, dtype="float32", device="cuda", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
