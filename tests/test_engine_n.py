"""SamplingParams.n > 1: n samples of one prompt, checked against n=1 runs and transformers' greedy."""
from __future__ import annotations

import pytest

from engine_fixtures import checkpoint, hf_greedy
from moe_infer import LLM, SamplingParams

PROMPT = list(range(3, 24))  # 21 tokens: 5 full blocks of 4 and one partial


@pytest.fixture(scope="module")
def llm():
    return LLM(model=checkpoint("qwen3_moe"), dtype="float32", device="cpu", block_size=4, num_kv_blocks=96,
               max_model_len=64)


def ids(tokens):
    return {"prompt_token_ids": list(tokens)}


@pytest.mark.timeout(180)
def test_greedy_samples_are_identical_and_equal_transformers(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    out = llm.generate(ids(PROMPT), params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1] and out.finished
    ref, _ = hf_greedy(checkpoint("qwen3_moe"), PROMPT, 8)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == ref
    assert all(c.finish_reason == "length" for c in out.outputs)


@pytest.mark.timeout(180)
def test_seeded_sample_i_equals_an_n1_run_with_seed_plus_i(llm):
    kw = dict(temperature=1.0, top_p=0.95, max_tokens=10, ignore_eos=True, logprobs=1)
    many = llm.generate(ids(PROMPT), SamplingParams(n=3, seed=40, **kw), use_tqdm=False)[0].outputs
    alone = [llm.generate(ids(PROMPT), SamplingParams(seed=40 + i, **kw), use_tqdm=False)[0].outputs[0]
             for i in range(3)]
    assert [c.token_ids for c in many] == [c.token_ids for c in alone]
    assert [c.cumulative_logprob for c in many] == pytest.approx([c.cumulative_logprob for c in alone])
    assert len({tuple(c.token_ids) for c in many}) == 3  # independent samples, not copies


@pytest.mark.timeout(180)
def test_samples_take_the_prompt_from_the_prefix_cache(llm):
    llm.generate(ids([1, 2]), SamplingParams(max_tokens=1), use_tqdm=False)
    bm = llm.engine.block_manager
    hits = bm.num_prefix_hits
    prompt = list(range(30, 51))  # not seen before: only the samples' own lookups can hit
    out = llm.generate(ids(prompt), SamplingParams(n=4, seed=1, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert bm.num_prefix_hits - hits == 3 * 5  # samples 1..3 each reuse the leader's 5 full blocks
    assert out.metrics.num_cached_prompt_tokens == 3 * 20 and out.num_cached_tokens == 0  # the leader computed it
    no_cache = LLM(model=checkpoint("qwen3_moe"), dtype="float32", device="cpu", block_size=4, num_kv_blocks=96,
                   max_model_len=64, enable_prefix_caching=False)
    again = no_cache.generate(ids(prompt), SamplingParams(n=4, seed=1, max_tokens=4, ignore_eos=True),
                              use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


@pytest.mark.timeout(180)
def test_batch_of_mixed_n_keeps_prompt_order(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    three = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=3)
    outs = llm.generate([ids([5, 6, 7]), ids(PROMPT), ids([9, 10])], [greedy, three, greedy], use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [1, 3, 1]
    single = llm.generate(ids(PROMPT), greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert all(c.token_ids == single for c in outs[1].outputs)


@pytest.mark.timeout(180)
def test_abort_finishes_every_sample_and_frees_their_blocks(llm):
    eng = llm.engine
    rid = eng.add_request(ids(PROMPT), SamplingParams(n=3, max_tokens=30, ignore_eos=True, seed=3))
    for _ in range(3):
        eng.step()
    assert eng.get_stats().num_running == 3
    eng.abort_request(rid)
    outs = [o for o in eng.step() if o.request_id == rid]
    assert len(outs) == 1 and [c.finish_reason for c in outs[0].outputs] == ["abort"] * 3
    assert eng.get_stats().num_free_kv_blocks == eng.block_manager.num_blocks and not eng.has_unfinished_requests()


@pytest.mark.timeout(180)
def test_a_failing_step_fails_every_sample_of_its_request(llm, monkeypatch):
    real = llm.engine.runner.launch  # every step, with or without async scheduling
    calls = {"n": 0}

    def flaky(plan, prev=None):
        calls["n"] += 1
        if calls["n"] == 2:  # the leader's prefill ran; this step holds the leader (and the other samples)
            raise RuntimeError("simulated device fault")
        return real(plan, prev)

    monkeypatch.setattr(llm.engine.runner, "launch", flaky)
    out = llm.generate(ids(PROMPT), SamplingParams(n=3, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert [c.finish_reason for c in out.outputs] == ["error"] * 3
    assert "simulated device fault" in out.outputs[1].error and not llm.engine.has_unfinished_requests()


@pytest.mark.timeout(180)
def test_stream_carries_every_sample(llm):
    params = SamplingParams(n=2, seed=9, max_tokens=6, ignore_eos=True)
    chunks = list(llm.generate_stream(ids(PROMPT), params))
    final = llm.generate(ids(PROMPT), params, use_tqdm=False)[0]
    assert chunks[-1].finished and len(chunks[-1].outputs) == 2
    assert [c.token_ids for c in chunks[-1].outputs] == [c.token_ids for c in final.outputs]
    assert all(len(c.outputs) == 2 for c in chunks)
