"""The engine against transformers' own classes with the same weights, for all four families.

Greedy generation of a batch of prompts of different lengths must be token-for-token identical to
HF `generate` (float32), and the engine's logprobs of every step (prefill and each decode) must
match the log-softmax of HF's scores: with a roomy cache, a tiny one that forces preemption, chunked
prefill (a small token budget), and prefix caching (shared prefixes, cache hits asserted).
"""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import checkpoint, hf_greedy
from moe_infer import LLM, SamplingParams
from moe_infer.layers.paged_attention import ATTENTION_BACKENDS
from tiny_hf import FAMILIES

NUM_NEW = 24

pytestmark = pytest.mark.timeout(180)  # an engine loop that stops making progress must fail, not spin
BLOCK = 4
_SHARED = [7, 19, 33, 41, 58, 62, 77, 80, 91, 15, 23, 104, 5, 66, 8, 120, 9, 44, 12, 101]
PROMPTS = [
    _SHARED + [30, 31],  # 22 tokens
    [11, 12, 13],  # 3 tokens
    _SHARED[:13] + [140, 141, 142, 143, 144, 145],  # shares 3 full blocks with the first
    list(range(40, 77)),  # 37 tokens: several chunks under a small budget
    # starts with the first prompt's 2nd and 3rd blocks, which that prompt holds at positions 4..11: same
    # tokens, other positions and context, so their KV must not be reused (the hash chains the prefix)
    _SHARED[4:12] + [150, 151, 152],
]
MODES = {
    "roomy": dict(num_kv_blocks=256, enable_prefix_caching=False),
    # 12 blocks x 4 = 48 slots: the longest request alone needs 61 tokens -> 16 blocks, so it must
    # run alone at times; preemption (recompute) is forced on the batch.
    "preempt": dict(num_kv_blocks=16, enable_prefix_caching=False),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=8, enable_prefix_caching=False),
    "prefix": dict(num_kv_blocks=256, enable_prefix_caching=True),
}

_REF = {}


def reference(family):
    if family not in _REF:
        path = checkpoint(family)
        _REF[family] = (path, [hf_greedy(path, p, NUM_NEW) for p in PROMPTS])
    return _REF[family]


def _check(outs, ref):
    for i, (out, (tokens, logprobs_SV)) in enumerate(zip(outs, ref)):
        comp = out.outputs[0]
        assert comp.finish_reason == "length", (i, comp.finish_reason, comp.error)
        assert comp.token_ids == tokens, f"prompt {i}: engine {comp.token_ids} != HF {tokens}"
        assert len(comp.logprobs) == NUM_NEW
        for step, (entry, token) in enumerate(zip(comp.logprobs, tokens)):
            assert entry[token].rank == 1
            ids = torch.tensor(list(entry))
            mine = torch.tensor([lp.logprob for lp in entry.values()])
            torch.testing.assert_close(mine, logprobs_SV[step, ids], atol=2e-4, rtol=1e-4,
                                       msg=lambda m: f"prompt {i} step {step}: {m}")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family, mode):
    path, ref = reference(family)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    sched, bm = llm.engine.scheduler, llm.engine.block_manager
    if mode == "prefix":  # a first request fills the cache; the batch then starts from its blocks
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        _check(first, ref[:1])
        hits_before = bm.num_prefix_hits
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check(outs, ref)
    if mode == "preempt":
        assert sched.num_preemptions > 0
        assert any(o.metrics.num_preemptions for o in outs)
    if mode == "chunked":
        assert sched.num_chunked_prefills > 0
    if mode == "prefix":
        assert bm.num_prefix_hits > hits_before
        cached = [o.metrics.num_cached_prompt_tokens for o in outs]
        assert cached[0] == 20 and cached[2] == 12, cached  # 5 and 3 full blocks of 4 from the cache
        assert cached[4] == 0, cached  # blocks that recur at another position are not a prefix hit
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks  # every block came back


@pytest.mark.gpu
@pytest.mark.timeout(600)  # the first GPU test of a process JIT-compiles the Triton kernels
@pytest.mark.parametrize("mode", ["preempt", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_cuda_fp32(family, mode):
    """The same on CUDA in float32, transformers on CUDA as the oracle (its own reduction order)."""
    path = checkpoint(family)
    ref = [hf_greedy(path, p, NUM_NEW, device="cuda") for p in PROMPTS]
    llm = LLM(model=path, dtype="float32", device="cuda", block_size=BLOCK, **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    _check(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False), ref)


@pytest.mark.timeout(400)  # the interpreter runs every attention call of the engine
def test_triton_attention_in_the_engine_interpreter():
    """The paged Triton attention kernel in the engine on CPU (Triton interpreter), chunked prefill: steps
    that mix decodes with prompt chunks reading earlier chunks from the cache; transformers' first tokens."""
    pytest.importorskip("moe_infer.layers.attention_triton")
    if torch.cuda.is_available():
        pytest.skip("the CUDA variant below runs it on the GPU")
    path, ref = reference("qwen3_moe")
    num_new = 6
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, attention_backend="triton",
              **MODES["chunked"])
    assert llm.engine.runner.model.layers[0].self_attn._attend is ATTENTION_BACKENDS.get("triton")
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.engine.scheduler.num_chunked_prefills > 0
    assert [o.outputs[0].token_ids for o in outs] == [tokens[:num_new] for tokens, _ in ref]


@pytest.mark.gpu
@pytest.mark.timeout(600)  # the first GPU test of a process JIT-compiles the Triton kernels
@pytest.mark.parametrize("mode", ["preempt", "chunked", "prefix"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_cuda_triton_attention(family, mode):
    """The paged Triton attention kernel (K/V read in place) inside the engine, float32 on CUDA."""
    path = checkpoint(family)
    ref = [hf_greedy(path, p, NUM_NEW, device="cuda") for p in PROMPTS]
    llm = LLM(model=path, dtype="float32", device="cuda", block_size=BLOCK, attention_backend="triton", **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    if mode == "prefix":
        _check(llm.generate(prompts[:1], params, use_tqdm=False), ref[:1])
    _check(llm.generate(prompts, params, use_tqdm=False), ref)
