"""The LLM API: bad input fails alone, text + stop strings, streaming, seeds, abort, metrics, expert load."""
from __future__ import annotations

import pytest

from engine_fixtures import checkpoint
from moe_infer import LLM, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.timeout(180)  # an engine loop that stops making progress must fail, not spin


@pytest.fixture(scope="module")
def llm():
    return LLM(model=checkpoint("qwen3_moe"), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
               max_model_len=48)


@pytest.fixture(scope="module")
def text_llm():  # every id of the 100-token vocabulary decodes to one character or a special token
    return LLM(model=checkpoint("olmoe", tokenizer=True, vocab_size=100), dtype="float32", device="cpu",
               block_size=4, num_kv_blocks=128)


def ids(*tokens):
    return {"prompt_token_ids": list(tokens)}


def test_bad_requests_fail_alone(llm):
    prompts = [ids(5, 6, 7), ids(*range(3, 60)), ids(8, 9, 500), "text but no tokenizer", ids(4, 5, 6, 7),
               {"prompt": 5}, ids(), ids(*range(3, 51))]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "error", "length",
                                                         "error", "error", "error"]
    errors = [o.outputs[0].error for o in outs]
    assert "max_model_len is 48" in errors[1] and "max_model_len is 48" in errors[7]
    assert "outside the vocabulary" in errors[2] and "[500]" in errors[2]
    assert "needs a tokenizer" in errors[3]
    assert "{'prompt': str}" in errors[5] and "keys ['prompt']" in errors[5] and "empty" in errors[6]
    off = LLM(model=checkpoint("qwen3_moe"), device="cpu", num_kv_blocks=8, collect_stats=False)
    assert off.get_expert_load() == []
    big = off.generate([ids(3, 4)], SamplingParams(logprobs=1000), use_tqdm=False)[0].outputs[0]
    assert big.finish_reason == "error" and "exceeds the vocabulary size 160" in big.error
    # a stop token the model cannot produce (one past int64 made the forward fail: schemathesis found it)
    for stop in ([160], [2**64]):
        bad = off.generate([ids(3, 4)], SamplingParams(stop_token_ids=stop, min_tokens=2), use_tqdm=False)[0].outputs[0]
        assert bad.finish_reason == "error" and f"stop_token_ids {stop} are outside the vocabulary" in bad.error
    assert all(len(outs[i].outputs[0].token_ids) == 12 for i in (0, 4))
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)  # in order


def test_prompt_bigger_than_the_cache_fails_alone():
    small = LLM(model=checkpoint("qwen3_moe"), dtype="float32", device="cpu", block_size=4, num_kv_blocks=6)
    outs = small.generate([ids(*range(3, 30)), ids(3, 4, 5)], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "can never fit in the KV cache" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length"


def test_bad_arguments_raise(llm):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([ids(1, 2)], [GREEDY, GREEDY])
    with pytest.raises(TypeError, match="unknown argument 'max_seqs'"):
        LLM(model="unused", max_seqs=3)
    with pytest.raises(ValueError, match="block_size"):
        LLM(model="unused", block_size=0)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([ids(1, 2)], SamplingParams(temperature=-1.0))


@pytest.mark.parametrize("prompts, error, match", [
    (42, TypeError, r"prompts must be a prompt or a list of prompts, got int: a prompt is a str"),
    (None, TypeError, r"got NoneType"),
    (b"def f", TypeError, r"got bytes"),
    (["x", 5], TypeError, r"prompts\[1\] is of type int: a prompt is a str"),
    ([[1, 2, 3]], TypeError, r"prompts\[0\] is of type list \(token ids go in \{'prompt_token_ids'"),
    ([ids(1, 2), {"prompt": "x", "prompt_token_ids": [1, 2]}], ValueError,
     r'prompts\[1\] has both "prompt" and "prompt_token_ids"'),
    ([{"prompt": "x", "max_tokens": 3}], ValueError, r"prompts\[0\] has unknown keys \['max_tokens'\]"),
    ([{"text": "x"}], ValueError, r"unknown keys \['text'\]"),
    ([{}], ValueError, r"prompts\[0\] is an empty dict"),
])
def test_malformed_prompts_raise_before_any_request(llm, prompts, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(error, match=match):
        next(llm.generate_stream(prompts, GREEDY))
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_a_failing_step_fails_only_its_requests(llm, monkeypatch):
    real = llm.engine.runner.launch  # every step, with or without async scheduling
    calls = {"n": 0}

    def flaky(plan, prev=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return real(plan, prev)

    monkeypatch.setattr(llm.engine.runner, "launch", flaky)
    first = llm.generate([ids(5, 6, 7)], GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].finish_reason == "error" and "simulated device fault" in first.outputs[0].error
    again = llm.generate([ids(5, 6, 7)], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].finish_reason == "length"


def test_seeded_sampling_alone_equals_inside_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=16, ignore_eos=True)
    alone = llm.generate([ids(10, 11, 12, 13)], seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate([ids(20, 21), ids(10, 11, 12, 13), ids(*range(30, 41))], [other, seeded, other],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert len(set(alone)) > 1


def test_engine_add_step_abort_and_stop_token(llm):
    eng = llm.engine
    a = eng.add_request(ids(5, 6, 7), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    b = eng.add_request(ids(8, 9), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    while not any(o.request_id == a and len(o.outputs[0].token_ids) == 2 for o in eng.step()):
        pass  # two steps; with async scheduling the outputs come one step later, a third step in flight
    eng.abort_request(a)
    seen = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id] = out
    assert seen[a].outputs[0].finish_reason == "abort" and len(seen[a].outputs[0].token_ids) == 2
    greedy_b = seen[b].outputs[0].token_ids
    assert len(greedy_b) == 30
    stop_id = greedy_b[5]
    out = llm.generate([ids(8, 9)], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    first = greedy_b.index(stop_id)
    assert out.finish_reason == "stop" and out.stop_reason == stop_id and out.token_ids == greedy_b[:first + 1]


def test_metrics_and_expert_load(llm):
    llm.reset_expert_load()
    outs = llm.generate([ids(5, 6, 7, 8), ids(9, 10)], GREEDY, use_tqdm=True)
    m = outs[0].metrics
    assert m.time_to_first_token > 0 and m.time_per_output_token > 0 and m.e2e_latency >= m.time_to_first_token
    load = llm.get_expert_load()
    arch = llm.engine.runner.arch
    assert [row["layer"] for row in load] == list(arch.moe_layer_ids)
    # tokens through each MoE layer: both prompts, then 11 decode steps of 2 sequences; the model's last layer
    # runs each prompt's last token only (model.prune_last_layer, moe_infer/layers/last_rows.py)
    last = arch.num_layers - 1
    assert llm.engine.runner.last_rows
    assert all(sum(row["routed"]) == ((1 + 1) if row["layer"] == last else (4 + 2)) * arch.top_k + 11 * 2 * arch.top_k
               for row in load)
    llm.reset_expert_load()
    assert all(sum(row["routed"]) == 0 for row in llm.get_expert_load())


def test_text_prompt_stop_string_and_logprob_tokens(text_llm):
    base = text_llm.generate("def f(x):", GREEDY, use_tqdm=False)[0]
    text = base.outputs[0].text
    as_dict = text_llm.generate({"prompt": "def f(x):"}, GREEDY, use_tqdm=False)[0]  # vLLM's TextPrompt
    assert (as_dict.prompt, as_dict.prompt_token_ids, as_dict.outputs[0].text) == (base.prompt, base.prompt_token_ids, text)
    assert base.prompt == "def f(x):" and len(base.prompt_token_ids) == 9
    as_ids = text_llm.generate({"prompt_token_ids": base.prompt_token_ids}, GREEDY, use_tqdm=False)[0]
    assert as_ids.prompt is None and as_ids.outputs[0].text == text  # ids are not decoded to a prompt (vLLM)
    named = text_llm.generate({"prompt_token_ids": base.prompt_token_ids, "prompt": "f"}, GREEDY, use_tqdm=False)[0]
    assert named.prompt == "f" and named.outputs[0].text == text
    assert len(text) >= 6, text
    stop = text[3:5]
    first = text.find(stop)
    out = text_llm.generate("def f(x):", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                        logprobs=2), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:first]
    tok = text_llm.get_tokenizer()
    assert all(lp[t].decoded_token == tok.decode([t]) for lp, t in zip(out.logprobs, out.token_ids))
    with_stop = text_llm.generate("def f(x):", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                              stop=stop, include_stop_str_in_output=True),
                                  use_tqdm=False)[0].outputs[0]
    assert with_stop.text == text[:first + len(stop)]


def test_streaming_yields_growing_outputs_then_the_final_one(text_llm):
    prompts = ["import os", "class A:"]
    final = text_llm.generate(prompts, GREEDY, use_tqdm=False)
    chunks = list(text_llm.generate_stream(prompts, GREEDY))
    assert all(isinstance(c, RequestOutput) for c in chunks)
    by_req = {}
    for c in chunks:
        prev = by_req.get(c.request_id)
        if prev is not None:
            assert c.outputs[0].token_ids[:len(prev.outputs[0].token_ids)] == prev.outputs[0].token_ids
            assert c.outputs[0].text.startswith(prev.outputs[0].text)
        by_req[c.request_id] = c
    lasts = list(by_req.values())
    assert all(c.finished for c in lasts) and len(lasts) == 2
    assert sorted(c.outputs[0].text for c in lasts) == sorted(f.outputs[0].text for f in final)
    assert sum(1 for c in chunks) >= 2 * 12  # one output per token per request
    via_flag = list(text_llm.generate("import os", GREEDY, stream=True))
    assert via_flag[-1].outputs[0].token_ids == final[0].outputs[0].token_ids


def test_streamed_text_never_shows_a_stop_string(text_llm):
    base = text_llm.generate("import sys", GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = base[4:7]
    first = base.find(stop)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop)
    chunks = list(text_llm.generate_stream("import sys", params))
    final = chunks[-1].outputs[0]
    assert final.finish_reason == "stop" and final.text == base[:first]
    assert all(final.text.startswith(c.outputs[0].text) for c in chunks)  # no stop-string prefix ever shown


def test_step_final_only_returns_finished_requests_only(llm):
    eng = llm.engine
    short = eng.add_request(ids(5, 6, 7), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    long = eng.add_request(ids(8, 9), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    progressed = eng.step()  # prefill: both sample their first token
    if not progressed:  # async scheduling: the prefill's outputs come with the next step
        progressed = eng.step()
    assert {o.request_id for o in progressed} == {short, long} and not any(o.finished for o in progressed)
    seen = []
    while eng.has_unfinished_requests():
        seen += eng.step(final_only=True)
    assert [o.request_id for o in seen] == [short, long] and all(o.finished for o in seen)
    assert [len(o.outputs[0].token_ids) for o in seen] == [2, 6]
