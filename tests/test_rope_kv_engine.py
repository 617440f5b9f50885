"""The fused rotary + K/V-write kernel (`moe_infer.kernels.rope_kv`) in the engine: the fused path against the
unfused one (RMSNorm modules, RotaryEmbedding.forward, store_kv + the paged kernel; same logprobs) and the
torch backend, per family and q/k norm mode (interpreter on CPU, CUDA with -m gpu); and which layers fuse
the norm. The kernel itself: tests/test_rope_kv.py.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

pytest.importorskip("moe_infer.kernels.rope_kv")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1", allow_module_level=True)


# ---- in the engine: the fused path changes no bit of the output (but a rare ulp of a fused norm) ----

ENGINE_PROMPTS = [[7, 19, 33, 41, 58, 62, 77, 80, 91, 15, 23], [11, 12, 13], list(range(40, 53))]
# (family, checkpoint overrides, the q/k norm the fused kernel applies)
ENGINE_CASES = [
    pytest.param("qwen3_moe", {}, "head", id="qwen3_moe-head_norm"),
    pytest.param("olmoe", {"clip_qkv": None}, "proj", id="olmoe-proj_norm"),
    pytest.param("olmoe", {}, "none", id="olmoe-clip_qkv"),  # clamped after the norm: the modules norm
]


def _engine_generate(family, device, backend, fused=True, monkeypatch=None, dtype="bfloat16", overrides=None,
                     fused_norm="none"):
    """Greedy tokens and top-3 logprobs of every step, chunked prefill; with fused=False the triton
    backend runs as before the fusion (RMSNorm modules, RotaryEmbedding.forward, then store_kv + the paged
    kernel). fused_norm: the q/k norm the fused kernel must apply."""
    from engine_fixtures import checkpoint
    from moe_infer import LLM, SamplingParams
    from moe_infer.layers.paged_attention import ROPE_FUSED_BACKENDS
    from moe_infer.plugins import load_plugins

    load_plugins()  # registers "triton" (the engine would, inside LLM)
    fused = fused and backend in ROPE_FUSED_BACKENDS
    if not fused and monkeypatch is not None:
        monkeypatch.delitem(ROPE_FUSED_BACKENDS._entries, backend)
    llm = LLM(model=checkpoint(family, **(overrides or {})), dtype=dtype, device=device, block_size=4,
              attention_backend=backend, num_kv_blocks=32, max_num_batched_tokens=8, enable_prefix_caching=False)
    model = llm.engine.runner.model
    layers = [model.layers[i].self_attn for i in model.local_layers]
    assert all((attn._rope_fused is not None) == fused for attn in layers)
    assert all(attn.fused_norm == (fused_norm if fused else "none") for attn in layers)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in ENGINE_PROMPTS], params, use_tqdm=False)
    assert llm.engine.scheduler.num_chunked_prefills > 0
    assert bool(model.rotary._tables) == fused  # the cos/sin table exists only where the fused kernel ran
    if monkeypatch is not None:
        monkeypatch.undo()
    return [(o.outputs[0].token_ids, [sorted(e.items()) for e in o.outputs[0].logprobs]) for o in outs]


def _logprob_values(result):
    return [(tokens, [[(i, lp.logprob, lp.rank) for i, lp in step] for step in steps]) for tokens, steps in result]


def _assert_same_generation(fused, unfused, fused_norm):
    """Bit for bit without a fused norm. With one, its float32 sum of squares is reduced in another order
    than the RMSNorm modules' (torch's, or the RMSNorm kernel's on CUDA), which may move a normed q/k value
    by one bf16 ulp (rarely: the interpreter runs here give the same bits): then the same greedy tokens, and
    the logprobs of the top-3 ids that both runs list within 0.05 (a bf16 ulp of a logit below 12.8)."""
    if fused_norm == "none" or _logprob_values(fused) == _logprob_values(unfused):
        assert _logprob_values(fused) == _logprob_values(unfused)
        return
    assert [tokens for tokens, _ in fused] == [tokens for tokens, _ in unfused]
    for (_, steps_f), (_, steps_u) in zip(fused, unfused):
        for step_f, step_u in zip(steps_f, steps_u):
            unfused_lps = dict(step_u)
            for i, lp in step_f:
                if i in unfused_lps:
                    assert abs(lp.logprob - unfused_lps[i].logprob) <= 0.05, (i, lp, unfused_lps[i])


@pytest.mark.timeout(400)  # the interpreter runs every attention call of the engine
@pytest.mark.parametrize("family,overrides,fused_norm", ENGINE_CASES)
def test_fused_engine_equals_unfused_interpreter(family, overrides, fused_norm, monkeypatch):
    """bf16: the fused path and the unfused one give the same logprobs (bit for bit without a fused norm)."""
    if DEV != "cpu":
        pytest.skip("the GPU variant below runs it on CUDA")
    fused = _engine_generate(family, "cpu", "triton", overrides=overrides, fused_norm=fused_norm)
    unfused = _engine_generate(family, "cpu", "triton", False, monkeypatch, overrides=overrides)
    _assert_same_generation(fused, unfused, fused_norm)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("overrides,fused_norm", [({}, "none"), ({"clip_qkv": None}, "proj")])
def test_fused_engine_tokens_equal_torch_backend_interpreter(overrides, fused_norm):
    """float32: the fused triton path's greedy tokens are the torch reference backend's. (bf16 tokens of the two
    backends may part after a near tie: their attention kernels round differently, before and after the fusion.
    qwen3_moe's float32 tokens are checked against transformers in test_engine_parity.py.)"""
    if DEV != "cpu":
        pytest.skip("test_engine_parity.py's CUDA triton tests run the fused path against transformers")
    fused = _engine_generate("olmoe", "cpu", "triton", dtype="float32", overrides=overrides, fused_norm=fused_norm)
    want = _engine_generate("olmoe", "cpu", "torch", dtype="float32", overrides=overrides)
    assert [t for t, _ in fused] == [t for t, _ in want]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,overrides,fused_norm", ENGINE_CASES)
def test_fused_engine_equals_unfused_gpu(family, overrides, fused_norm, monkeypatch):
    """bf16 on CUDA (decode steps in CUDA graphs): the same logprobs, fused or not (bit for bit without a
    fused norm; the unfused norm is the RMSNorm kernel there)."""
    fused = _engine_generate(family, "cuda", "triton", overrides=overrides, fused_norm=fused_norm)
    unfused = _engine_generate(family, "cuda", "triton", False, monkeypatch, overrides=overrides)
    _assert_same_generation(fused, unfused, fused_norm)


def test_attention_fuses_the_norm_where_it_can():
    """The fused kernel takes the q/k norm per head, and over the whole projection at tp = 1 without clip_qkv;
    under tp > 1 (ShardedRMSNorm), with clip_qkv, or with a backend without the fused kernel, the modules norm."""
    from dataclasses import replace

    from engine_fixtures import checkpoint
    from moe_infer.layers.attention import Attention
    from moe_infer.layers.tensor_parallel import SINGLE, ShardGroup
    from moe_infer.models.hf_config import load_arch
    from moe_infer.plugins import load_plugins

    load_plugins()
    qwen3, olmoe = load_arch(checkpoint("qwen3_moe"))[0], load_arch(checkpoint("olmoe"))[0]
    assert (qwen3.qk_norm, olmoe.qk_norm, olmoe.clip_qkv) == ("head", "proj", 2.5)
    tp2 = ShardGroup(object(), 0, 2)  # no collective runs here

    def fused_norm(arch, backend="triton", tp=SINGLE):
        return Attention(arch, 0, None, torch.float32, backend, tp).fused_norm

    assert fused_norm(qwen3) == "head" and fused_norm(qwen3, tp=tp2) == "head"
    assert fused_norm(replace(olmoe, clip_qkv=None)) == "proj"
    assert fused_norm(replace(olmoe, clip_qkv=None), tp=tp2) == "none"
    assert fused_norm(olmoe) == "none"
    assert fused_norm(replace(qwen3, qk_norm="none")) == "none"
    assert fused_norm(qwen3, backend="torch") == "none"
