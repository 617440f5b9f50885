"""Detokenization on the client side of an engine core: an engine with detokenize=False, its deltas pickled
and applied to DetokenizingAssemblers whose stop commands reach the engine `lag` steps late (as over the
core's pipe), gives the offline engine's final outputs: texts, token ids, finish and stop reasons, logprobs
with their decoded tokens, cumulative logprobs; streamed texts only grow; every KV block comes back."""
from __future__ import annotations

import pickle

import pytest

from moe_infer import LLM, SamplingParams
from moe_infer.assets import default_model_path
from moe_infer.engine.detok_assembler import DetokenizingAssembler
from moe_infer.engine.llm_engine import LLMEngine
from moe_infer.engine.output_delta import DeltaEncoder

pytestmark = pytest.mark.timeout(300)

KW = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=96, max_num_seqs=8)
REQUESTS = {
    "greedy": ("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
    "stop": ("class Foo:", SamplingParams(temperature=0, max_tokens=40, stop=["\n\n", "self"])),
    "stop_kept": ("class Foo:", SamplingParams(temperature=0, max_tokens=40, stop=["self"],
                                               include_stop_str_in_output=True, logprobs=2)),
    "n2": ("def main():", SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=24, logprobs=3,
                                         stop=["self", '"""'])),
    "stop_at_length": ("class Foo:", SamplingParams(temperature=0, max_tokens=3, stop=["\n\n", "self"])),
    "lp": ("for i in range(3):", SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)),
    "bad": ({"prompt_token_ids": [1, 10**7]}, SamplingParams(max_tokens=4)),
}


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**KW)
    outs = llm.generate([p for p, _ in REQUESTS.values()], [sp for _, sp in REQUESTS.values()], use_tqdm=False)
    return dict(zip(REQUESTS, outs)), llm


def run_with_client_detok(llm, lag: int):
    engine = LLMEngine(llm.engine.cfg, default_model_path(), detokenize=False)
    stops, finals, texts = [], {}, {}
    assemblers = {}
    for rid, (prompt, params) in REQUESTS.items():
        engine.add_request(prompt, params, rid)
        req = engine.requests.get(rid)
        ids = list(req.children[0].seq.prompt_token_ids) if req is not None else []
        assemblers[rid] = DetokenizingAssembler(rid, None, ids, params, llm.engine.tokenizer,
                                                lambda r, i, s: stops.append([lag, r, i, s]))
    encoder, steps, kinds = DeltaEncoder(), 0, set()
    while engine.has_unfinished_requests():
        steps += 1
        for cmd in [c for c in stops if c[0] == 0]:
            engine.stop_sample(*cmd[1:])
            stops.remove(cmd)
        for cmd in stops:
            cmd[0] -= 1
        for wire in engine.step(encoder=encoder):
            wire = pickle.loads(pickle.dumps(wire))
            kinds.add(len(wire))
            assert len(wire) == 2 or all(c[2] == "" for c in wire[1])  # the engine sent no text
            out = assemblers[wire[0]].apply(wire)
            for c in out.outputs:
                prev = texts.get((out.request_id, c.index), "")
                if c.finish_reason is None:
                    assert c.text.startswith(prev), (out.request_id, prev, c.text)  # a stream's text only grows
                texts[(out.request_id, c.index)] = c.text
            if out.finished:
                finals[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for rid, asm in assemblers.items():  # the engine ended a sample stopped by the client soon after
        for c, final in zip(asm._base.choices, finals[rid].outputs):
            assert len(c.token_ids) <= len(final.token_ids) + lag + 2, (rid, c.index)
    assert kinds == {2, 5}  # token-only deltas and full ones both came
    return finals, engine


@pytest.mark.parametrize("lag", [0, 2])
def test_client_side_detokenization_gives_the_engines_outputs(reference, lag):
    refs, llm = reference
    assert refs["stop"].outputs[0].finish_reason == "stop" and refs["stop_kept"].outputs[0].stop_reason == "self"
    assert {c.finish_reason for c in refs["n2"].outputs} == {"stop"}  # the samples stop...
    assert len({len(c.token_ids) for c in refs["n2"].outputs}) == 2  # ...at different lengths
    at_length = refs["stop_at_length"].outputs[0]  # its last token completes "self": the engine keeps "length"
    assert (at_length.finish_reason, at_length.text) == ("length", refs["stop"].outputs[0].text)
    finals, engine = run_with_client_detok(llm, lag)
    assert set(finals) == set(REQUESTS)
    for rid, want in refs.items():
        got = finals[rid]
        assert len(got.outputs) == len(want.outputs)
        for g, w in zip(got.outputs, want.outputs):
            assert (g.text, g.token_ids, g.finish_reason, g.stop_reason, g.error) == (
                w.text, w.token_ids, w.finish_reason, w.stop_reason, w.error), (rid, g.index)
            assert same_logprobs(g.logprobs, w.logprobs), (rid, g.index)
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4), rid
    assert engine.requests == {}


def same_logprobs(got, want) -> bool:
    """Equal token ids, ranks and decoded tokens; values within float32 noise (batches differ with the lag)."""
    if got is None or want is None:
        return got is want
    return len(got) == len(want) and all(
        g.keys() == w.keys() and all((g[t].rank, g[t].decoded_token) == (w[t].rank, w[t].decoded_token)
                                     and abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g)
        for g, w in zip(got, want))


def _wire(ids, k, finish=None):
    """The delta that adds ids[k] to sample 0 (what the core sends: no text)."""
    return ("r", [(0, 0, "", k, [ids[k]], None, None, finish, None, None)], finish is not None, None, 0)


def test_a_sample_ended_by_length_mid_character_ends_with_the_full_decode(reference):
    tokenizer = reference[1].engine.tokenizer
    ids = tokenizer("naive 😀 ok")["input_ids"]
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))  # inside the emoji
    asm = DetokenizingAssembler("r", None, [1, 2], SamplingParams(max_tokens=cut), tokenizer, None)
    wires = [_wire(ids, k) for k in range(cut - 1)] + [_wire(ids, cut - 1, "length")]
    texts = [asm.apply(w).outputs[0].text for w in wires]
    assert not any("\ufffd" in t for t in texts[:-1])  # half a character is held back while running...
    assert texts[-1] == tokenizer.decode(ids[:cut], skip_special_tokens=True)  # ...and shown at the end


def test_a_stopped_sample_ignores_what_the_core_sends_after(reference):
    tokenizer = reference[1].engine.tokenizer
    ids = tokenizer("x = 1\ny = 2\nz = 3")["input_ids"]
    stops = []
    asm = DetokenizingAssembler("r", None, [1, 2], SamplingParams(max_tokens=50, stop=["y"]), tokenizer,
                                lambda *a: stops.append(a))
    outs = [asm.apply(_wire(ids, k)).outputs[0] for k in range(len(ids))]
    first = next(i for i, o in enumerate(outs) if o.finish_reason is not None)
    assert stops == [("r", 0, "y")] and outs[first].text == "x = 1\n"
    assert all(o == outs[first] for o in outs[first:])  # later tokens (the core ran on) change nothing
    assert outs[first].token_ids == ids[:first + 1]


def test_logprob_tokens_are_decoded_as_the_engine_decodes_them(reference):
    """Special tokens among the top logprobs show their text (the engine's `tokenizer.decode([id])`)."""
    from moe_infer.engine.outputs import Logprob

    tokenizer = reference[1].engine.tokenizer
    eos = tokenizer.all_special_ids[0]
    entry = {5: Logprob(-0.1, 1), eos: Logprob(-2.5, 2)}
    wire = ("r", [(0, 0, "", 0, [5], [entry], -0.1, None, None, None)], False, None, 0)
    asm = DetokenizingAssembler("r", None, [1, 2], SamplingParams(max_tokens=4, logprobs=1), tokenizer, None)
    got = asm.apply(wire).outputs[0].logprobs[0]
    assert {t: lp.decoded_token for t, lp in got.items()} == {5: tokenizer.decode([5]), eos: tokenizer.decode([eos])}
