"""Speculative decoding with async scheduling (moe_infer/engine/speculative/speculator.py, async_scheduling.py): plain
steps of a speculating engine are launched while the step before them runs (lookahead), verify steps are scheduled
with every token on the host; the greedy tokens are transformers' (tests/tiny_hf.py's random checkpoint).

Each test spies on `ModelRunner.launch`: which steps were launched with a step in flight (`prev`), which verified.
"""
from __future__ import annotations

import pytest

from engine_fixtures import checkpoint, hf_greedy
from moe_infer import LLM, SamplingParams
from moe_infer.engine.async_scheduling import AsyncStepExecutor
from moe_infer.engine.sequence import ScheduledSeq, SchedulerOutput

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
REPEATING = [7, 19, 33, 41, 58, 62, 77, 80] * 3 + [7, 19]  # the n-gram finds its continuation
ODD = list(range(100, 112))  # no token twice: the n-gram finds nothing until the output repeats


def _launches(llm):
    """The launched plans as (launched with a step in flight, the plan), in order."""
    runner, seen = llm.engine.runner, []
    launch = runner.launch

    def spy(plan, prev=None):
        if not plan.is_empty:
            seen.append((prev is not None, plan))
        return launch(plan, prev)

    runner.launch = spy
    return seen


def _verifies(plan: SchedulerOutput) -> bool:
    return any(item.spec_token_ids for item in plan.seqs)


def _check_async(llm, seen):
    """Plain decode steps went through lookahead; every verify step was launched with nothing in flight."""
    eng = llm.engine
    assert isinstance(eng.executor, AsyncStepExecutor), type(eng.executor)
    plain_behind = [p for behind, p in seen if behind and not _verifies(p)
                    and all(len(item.token_ids) == 1 for item in p.seqs)]
    assert plain_behind and eng.executor.num_lookahead_steps >= len(plain_behind)
    assert any(_verifies(p) for _, p in seen)
    assert not any(behind for behind, p in seen if _verifies(p)), "a verify step launched behind a step in flight"
    stats = eng.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "KV blocks leaked"


def test_ngram_mixed_batch_with_lookahead_equals_transformers():
    """A repeating prompt beside one without repeats: the first verifies (n-gram found in its tokens before the
    last), the second runs one token in the same verify steps; steps where neither may propose run with lookahead."""
    path = checkpoint("qwen3_moe")
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 3, "adaptive": False})
    seen = _launches(llm)
    n = 24
    outs = llm.generate([{"prompt_token_ids": p} for p in (REPEATING, ODD)],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, n)[0] for p in (REPEATING, ODD)]
    _check_async(llm, seen)
    mixed = [p for _, p in seen if _verifies(p) and any(len(item.token_ids) == 1 for item in p.seqs)]
    assert mixed, "no step where one sequence verified and another decoded one token"
    assert llm.engine.speculator.num_drains > 0
    stats = llm.engine.get_stats()
    assert stats.num_spec_accepted_tokens > 0


def test_draft_with_lookahead_equals_transformers():
    """The draft (the target's own weights: every proposal must be accepted) with speculation off at batch 2
    (`disable_by_batch_size`): the two sequences decode with lookahead, the draft not running; once the short one
    ends, the long one verifies: the draft catches up on the tokens it did not see, and the tokens stay
    transformers'."""
    path = checkpoint("qwen3_moe")
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256,
              speculative_config={"method": "draft", "draft_model": path, "num_speculative_tokens": 3,
                                  "adaptive": False, "disable_by_batch_size": 2})
    seen = _launches(llm)
    prompts, lens = (REPEATING, ODD), (28, 10)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, m)[0] for p, m in zip(prompts, lens)]
    _check_async(llm, seen)
    stats = llm.engine.get_stats()
    assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens > 0


def test_seeded_and_logprobs_with_lookahead_equal_the_plain_engine():
    """Logprobs of greedy requests, and a seeded request whose steps verify or not by its own tokens: equal to the
    engine without speculation where greedy; the seeded request draws the same tokens alone and beside others."""
    path = checkpoint("qwen3_moe")
    kw = dict(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256)
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                   "adaptive": False}, **kw)
    plain = LLM(**kw)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in (REPEATING, ODD)]
    a, b = plain.generate(prompts, greedy, use_tqdm=False), spec.generate(prompts, greedy, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert [list(e) for e in x.outputs[0].logprobs] == [list(e) for e in y.outputs[0].logprobs]
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, ignore_eos=True, seed=11)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = spec.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = spec.generate(prompts + [{"prompt_token_ids": REPEATING[3:]}], [seeded, other, other], use_tqdm=False)
    assert alone == batch[0].outputs[0].token_ids
    assert spec.engine.executor.num_lookahead_steps > 0 and spec.engine.get_stats().num_spec_proposed_tokens > 0


def _speculator(clock=None, **spec):
    from moe_infer.config import EngineConfig, SpeculativeConfig
    from moe_infer.engine.speculative.speculator import Speculator

    cfg = EngineConfig(speculative=SpeculativeConfig(method="ngram", adaptive=False, **spec))
    kw = {} if clock is None else {"clock": clock}
    return Speculator(cfg, runner=None, block_manager=None, max_model_len=1024, lookahead=True, **kw)


def _decoding(tokens, in_flight):
    """A decoding sequence whose host tokens are `tokens` and whose next token is in flight (or not)."""
    from moe_infer.engine.sequence import Sequence, SequenceStatus

    seq = Sequence("r", tokens[:2], SamplingParams(temperature=0.0))
    seq.token_ids = list(tokens)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = len(tokens) - 1
    if in_flight:  # its last step is in flight: the KV of every host token is being computed, one token to come
        seq.num_in_flight = seq.num_pending_tokens = seq.num_placeholders = 1
    return seq


def test_the_drain_reads_a_sequences_tokens_before_its_last():
    """Whether a sequence proposes reads its tokens before the last one, in flight or on the host alike: the same
    history (its last token 3 completes the recurring suffix 2, 3) proposes in neither case, and one more token
    (its suffix 2, 3 recurs without the last) in both; the step drains for it. After a verify step of its own, and
    at its first output token, it reads every token (a first token in flight is drained for)."""
    history = [1, 2, 3, 4, 5, 2]
    spec = _speculator(prompt_lookup_min=2, prompt_lookup_max=2)
    last_is_3 = _decoding(history + [3], in_flight=False)
    assert not spec._may_propose(_decoding(history, in_flight=True)) and not spec._may_propose(last_is_3)
    behind = _decoding(history + [3], in_flight=True)
    assert spec._may_propose(behind) and spec._may_propose(_decoding(history + [3, 9], in_flight=False))
    assert spec.must_drain([behind], SchedulerOutput())
    assert not spec.must_drain([_decoding(history, in_flight=True)], SchedulerOutput())
    spec.record(SchedulerOutput(seqs=[ScheduledSeq(last_is_3.seq_id, [2, 3], 5, [], True, SamplingParams(),
                                                   spec_token_ids=[3])]), [[3]])
    assert spec._may_propose(last_is_3)  # its verify step was collected: its last token counts
    spec.record(SchedulerOutput(seqs=[ScheduledSeq(last_is_3.seq_id, [3], 6, [], True, SamplingParams())]), [3])
    assert not spec._may_propose(last_is_3)
    first = _decoding([1, 2, 1, 2, 5, 2], in_flight=True)  # a prompt whose first output token is in flight
    first.num_prompt_tokens = len(first.token_ids)
    assert spec._may_propose(first) and spec.must_drain([first], SchedulerOutput())
    first.token_ids.append(3)
    first.num_in_flight = first.num_pending_tokens = first.num_placeholders = 0
    assert not spec._may_propose(first)  # [.., 2, 3] does not recur: read with its first token
    first.token_ids[-1] = 1
    assert spec._may_propose(first)  # [.., 2, 1] does


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self):
        return self.now


def test_adaptive_k_times_lookahead_steps_and_verify_steps():
    """The step times adaptive k compares (injected clock): a lookahead plain step's is the time between collected
    steps (1 s here), a verify step's from the drained step to its own tokens (5 s); a plain step launched into an
    idle pipeline (the first, or the first after a verify step) is not timed, nor a drained one (on a host-bound
    device its time would miss its own launch)."""
    clock = _Clock()
    spec = _speculator(clock=clock, num_speculative_tokens=2)
    params = SamplingParams(temperature=0.0)
    plain = lambda: SchedulerOutput(seqs=[ScheduledSeq(0, [5], 10, [], True, params)])  # noqa: E731
    verify = lambda: SchedulerOutput(seqs=[ScheduledSeq(0, [5, 6, 7], 10, [], True, params,  # noqa: E731
                                                        spec_token_ids=[6, 7])])

    def run(plan, behind, k=0):
        spec.last_k = k
        spec.launched(plan, behind)
        return plan

    spec.begin_step(False)
    p = run(plain(), False)  # into an idle pipeline: not timed
    for _ in range(2):
        for _ in range(3):  # lookahead: launch the next, then collect the one before (1 s a step)
            spec.begin_step(True)
            nxt = run(plain(), True)
            clock.now += 1.0
            spec.record(p, [9])
            p = nxt
        spec.begin_step(True)  # drain (the sequence may propose), then a verify step collected at once
        assert spec.must_drain([_decoding([1, 2, 1, 2, 1], in_flight=True)], p)
        clock.now += 1.0
        spec.record(p, [9])
        v = run(verify(), False, k=2)
        clock.now += 5.0
        spec.record(v, [[6, 7, 8]])
        spec.begin_step(False)  # lookahead resumes: the first plain step is launched with nothing in flight
        p = run(plain(), False)
        clock.now += 0.5
    # 8 collected plain steps: the 2 launched into an idle pipeline and the 2 drained ones left out
    assert spec.costs.counts[(1, 0)] == 4
    assert spec.costs.counts[(1, 2)] == 2
    assert spec.costs.seconds[(1, 0)] == pytest.approx(1.0) and spec.costs.seconds[(1, 2)] == pytest.approx(5.0)
