"""Output deltas (what the engine core process sends): encoded, pickled and applied, they rebuild every
cumulative RequestOutput the engine itself returned, step by step: greedy and seeded n=2 samples, stop
strings, logprobs, an abort, a rejected request; and texts or token lists that shrink."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from moe_infer import LLM, SamplingParams
from moe_infer.assets import default_model_path
from moe_infer.engine.llm_engine import LLMEngine
from moe_infer.engine.output_delta import DeltaEncoder, OutputAssembler
from moe_infer.engine.outputs import CompletionOutput, Logprob, RequestOutput

pytestmark = pytest.mark.timeout(120)


def through_the_pipe(assemblers, wire):
    wire = pickle.loads(pickle.dumps(wire))
    return assemblers[wire[0]].apply(wire)


@pytest.mark.parametrize("detokenize", [True, False])
def test_deltas_rebuild_every_output_of_an_engine_run(detokenize):
    """The engine core's path (`step(encoder=...)`, deltas read from the requests' state) against each
    request's own cumulative output after the same step. detokenize=False (as in the core): most deltas are
    token-only ones."""
    llm = LLM(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=4)
    engine = llm.engine if detokenize else LLMEngine(llm.engine.cfg, default_model_path(), detokenize=False)
    requests = {
        "greedy": ("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
        "stop": ("class Foo:", SamplingParams(temperature=0, max_tokens=40, stop=["\n\n", "self"])),
        "n2": ("import os", SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=16, logprobs=3)),
        "lp": ("for i in range(3):", SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)),
        "abort": ("x = [1, 2", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)),
        "bad": ({"prompt_token_ids": [1, 10**7]}, SamplingParams(max_tokens=4)),
    }
    encoder, assemblers, states, rejected = DeltaEncoder(), {}, {}, None
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
        req = engine.requests.get(rid)
        if req is None:  # rejected at once: its output waits for the next step
            rejected = engine._pending[-1]
        states[rid] = req
        ids = list(req.children[0].seq.prompt_token_ids) if req is not None else []
        text = req.children[0].seq.prompt if req is not None else None
        assemblers[rid] = OutputAssembler(rid, text, ids, params.n, params.logprobs is not None)
    seen, steps, kinds = set(), 0, []
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 6:
            engine.abort_request("abort")
        for wire in engine.step(encoder=encoder):
            kinds.append(len(wire))
            got = through_the_pipe(assemblers, wire)
            rid = got.request_id
            want = rejected if states[rid] is None else states[rid].output()
            if not want.finished:
                want = dataclasses.replace(want, metrics=None)  # metrics come with the finished output
            if rid == "bad":
                want = dataclasses.replace(want, prompt_token_ids=got.prompt_token_ids, prompt=got.prompt)
            assert got == want, (rid, steps)
            seen.add((rid, got.finished))
    assert {rid for rid, done in seen if done} == set(requests)
    assert encoder._sent == {}  # finished requests are forgotten
    reasons = {rid: [c.finish_reason for c in assemblers[rid].choices] for rid in requests}
    assert reasons["abort"] == ["abort"] and reasons["bad"] == ["error"] and reasons["greedy"] == ["length"]
    # the same long prompt twice: the second finds its blocks in the prefix cache, and every output of it
    # (the token-only deltas' too) says how many prompt tokens were cached
    prompt = "def fibonacci(n):\n    return n\n" * 8
    for rid in ("first", "cached"):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), rid)
        req = engine.requests[rid]
        assemblers[rid] = OutputAssembler(rid, prompt, list(req.children[0].seq.prompt_token_ids), 1)
        while engine.has_unfinished_requests():
            for wire in engine.step(encoder=encoder):
                kinds.append(len(wire))
                got, want = through_the_pipe(assemblers, wire), req.output()
                assert got == (want if want.finished else dataclasses.replace(want, metrics=None)), rid
    assert got.num_cached_tokens >= 32 and len(got.prompt_token_ids) > 48
    if detokenize:  # stop strings are the client's when the engine does not detokenize
        assert reasons["stop"] == ["stop"] and assemblers["stop"].choices[0].stop_reason in ("\n\n", "self")
        assert 2 not in kinds  # texts grow every step: full deltas only
    else:
        assert kinds.count(2) > kinds.count(5)
    assert len(assemblers["n2"].choices) == 2 and all(len(c.logprobs) == len(c.token_ids)
                                                      for c in assemblers["n2"].choices)


def _out(text, ids, finished=False, logprobs=(), reason=None):
    c = CompletionOutput(0, text, list(ids), list(logprobs), 0.0, reason)
    return RequestOutput("r", "p", [1], [c], finished)


def test_a_text_or_token_list_that_shrinks_arrives_right():
    lp = lambda t: {t: Logprob(-0.5, 1, str(t))}  # noqa: E731
    outputs = [_out("", []), _out("ab", [1, 2], logprobs=[lp(1), lp(2)]),
               _out("abcdef", [1, 2, 3], logprobs=[lp(1), lp(2), lp(3)]),
               _out("abcX", [1, 2, 3], logprobs=[lp(1), lp(2), lp(3)]),  # a held-back tail cut and replaced
               _out("abcX", [1, 2, 3], logprobs=[lp(1), lp(2), lp(3)]),  # nothing new
               _out("ab", [1, 2], True, [lp(1), lp(2)], "stop")]
    encoder, asm = DeltaEncoder(), {"r": OutputAssembler("r", "p", [1], 1, logprobs=True)}
    for out in outputs:
        got = through_the_pipe(asm, encoder.encode(out))
        assert got == (out if out.finished else dataclasses.replace(out, metrics=None))
    assert encoder.encode(_out("", []))[1] == []  # a new request of the same id starts afresh
