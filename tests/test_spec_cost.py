"""Adaptive k from measured step times (moe_infer/engine/speculative/cost.py): the policy with injected costs, and the
speculator timing its steps through an injected clock."""
from __future__ import annotations

import pytest

from moe_infer.engine.speculative.cost import PROBE_EVERY, SKIP_FIRST, StepCosts, choose_k

pytestmark = pytest.mark.timeout(60)


def _costs(batch, seconds_by_k, samples=5):
    costs = StepCosts()
    for k, sec in enumerate(seconds_by_k):
        for _ in range(samples):
            costs.add(batch, k, sec)
    return costs


def _choose(costs, batch, a, step=1, max_k=3):
    return choose_k(costs, batch, max_k, a, saturation=32.0, proposal_cost=0.0, step_index=step)


def test_cheap_verify_steps_speculate_fully():
    # a verify step barely costlier than a decode step: k = 3 gives 1 + .6 + .36 + .216 tokens for 1.15x the time
    assert _choose(_costs(1, [1.0, 1.05, 1.1, 1.15]), 1, 0.6) == 3


def test_expensive_verify_steps_turn_speculation_off():
    # the same batch and acceptance, verify steps measured at 3x: a plain step is faster (the prior alone would
    # speculate at batch 1: k = 3 at 1 + 3/32 of a step)
    assert _choose(_costs(1, [1.0, 3.0, 3.0, 3.0]), 1, 0.6) == 0
    assert _choose(StepCosts(), 1, 0.6) == 3  # nothing measured: the prior


def test_costs_in_between_pick_the_best_ratio():
    # rates: k0 1/1, k1 1.6/1.2 = 1.33, k2 1.96/1.9 = 1.03, k3 2.18/2.6 = 0.84
    assert _choose(_costs(4, [1.0, 1.2, 1.9, 2.6]), 4, 0.6) == 1
    # low acceptance: even cheap verify steps do not pay
    assert _choose(_costs(4, [1.0, 1.2, 1.9, 2.6]), 4, 0.1) == 0


def test_costs_are_kept_per_batch_bucket_and_skip_the_first_sample():
    costs = _costs(1, [1.0, 1.05, 1.1, 1.15])
    for k, sec in enumerate([1.0, 4.0, 4.0, 4.0]):
        for _ in range(5):
            costs.add(16, k, sec)
    assert _choose(costs, 1, 0.6) == 3 and _choose(costs, 16, 0.6) == 0 and _choose(costs, 12, 0.6) == 0
    one = StepCosts()
    one.add(2, 1, 100.0)  # a step that captured a graph
    assert one.count(2, 1) == 1 and (2, 1) not in one.seconds and SKIP_FIRST == 1


def test_a_capture_outlier_is_left_out_a_lasting_change_is_not():
    costs = _costs(1, [1.0], samples=5)
    costs.add(1, 0, 50.0)  # a step that captured a graph for a new context bucket
    assert costs.seconds[(1, 0)] == pytest.approx(1.0)
    for _ in range(3):  # the step really got slower
        costs.add(1, 0, 5.0)
    assert costs.seconds[(1, 0)] > 4.0


def test_unmeasured_k_is_estimated_from_a_measured_one():
    costs = StepCosts()
    for _ in range(4):
        costs.add(1, 0, 2.0)
    prior = [1.0, 1.5, 2.0]
    assert costs.estimate(1, 2, prior) == pytest.approx(4.0)  # 2.0 s * 2.0 / 1.0


def test_probe_measures_the_least_measured_k():
    costs = _costs(1, [1.0, 3.0, 3.0], samples=5)
    costs.add(1, 3, 3.0)  # k = 3 seen once (left out): the least measured
    assert _choose(costs, 1, 0.6, step=PROBE_EVERY) == 3
    assert _choose(costs, 1, 0.6, step=PROBE_EVERY + 1) == 0


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_speculator_times_decode_steps_at_their_k():
    """The engine's speculator files each all-decode step's clock time under its batch and k; once verify steps are
    measured slow at batch 1, adaptive k turns speculation off."""
    from moe_infer import LLM, SamplingParams
    from moe_infer.engine.speculative.speculator import Speculator
    from engine_fixtures import checkpoint

    llm = LLM(model=checkpoint("qwen3_moe"), dtype="float32", device="cpu", block_size=4, num_kv_blocks=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    eng = llm.engine
    clock = _Clock()
    spec = eng.speculator = Speculator(eng.cfg, eng.runner, eng.block_manager, eng.max_model_len, clock=clock,
                                       lookahead=eng.speculator.lookahead)
    assert spec.lookahead  # plain steps run with async scheduling: their time is the lookahead step's
    record = spec.record

    ks = []  # per collected step: its k (0: a plain step)

    def slow_verify(plan, tokens):  # a verify step takes 5 s of the clock, a plain decode step 1 s
        k = max(len(s.spec_token_ids) for s in plan.seqs) if plan.seqs else 0
        clock.now += 5.0 if k else 1.0
        ks.append(k)
        record(plan, tokens)

    spec.record = slow_verify
    llm.generate([{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}],
                 SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True), use_tqdm=False)
    assert spec.costs.seconds[(1, 0)] == pytest.approx(1.0)
    assert any(spec.costs.seconds.get((1, k)) == pytest.approx(5.0) for k in (1, 2))
    late = ks[-30:]
    assert late.count(0) >= len(late) - 2, ks  # off but for the probes (every 8th step until each k has 3 samples)
