"""The prefetch decision (moe_infer/offload/prefetch.py): the `saving` rule on hand-made cases, its
calibration, the store acting on it (a confident prediction replaces a cold expert, a weak one does
not evict a likely one), and the CPU replay of benchmarks/offload_replay.py on traced routing."""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

from moe_infer.config import OffloadConfig
from moe_infer.offload.prefetch import PREFETCH_RULES, Calibration, mass_bin
from test_offload_cache import D, _checking_compute, _stores

saving, take_all = PREFETCH_RULES.get("saving"), PREFETCH_RULES.get("all")


# ------------------------------------------------------------------ the rule alone
@pytest.mark.timeout(10)
def test_a_confident_candidate_replaces_a_cold_expert_and_a_weak_one_does_not_evict_a_likely_one():
    # (candidates, residents coldest first by the cache policy, free slots, limit, miss_s, link_s, min_prob)
    assert saving([(5, 0.95)], [(1, 0.05)], 0, 2, 1.0, 0.5, 0.3) == [(5, 1)]
    assert saving([(5, 0.6)], [(1, 0.5)], 0, 2, 1.0, 0.5, 0.3) == []  # 0.6 - 0.5 - 0.5 < 0: the resident stays
    assert saving([(5, 0.6)], [(1, 0.05)], 0, 2, 1.0, 0.5, 0.3) == [(5, 1)]  # ... but a cold one goes


@pytest.mark.timeout(10)
def test_the_link_cost_and_the_floor_decide_for_a_free_slot():
    assert saving([(5, 0.6)], [], 1, 2, 1.0, 0.7, 0.3) == []  # a busy link: 0.6 < 0.7
    assert saving([(5, 0.6)], [], 1, 2, 1.0, 0.1, 0.3) == [(5, None)]  # an idle one
    assert saving([(5, 0.25)], [], 1, 2, 1.0, 0.0, 0.3) == []  # below prefetch_min_prob
    assert saving([(5, 0.25)], [], 1, 2, 1.0, 0.0, 0.2) == [(5, None)]
    assert saving([(5, 0.6)], [], 1, 2, 2.0, 1.0, 0.3) == [(5, None)]  # a miss costs twice a copy (1.2 > 1.0)


@pytest.mark.timeout(10)
def test_the_likeliest_candidate_takes_the_least_likely_slot_first():
    residents = [(1, 0.6), (2, 0.01)]  # the cache policy's order (1 coldest) is not the likelihood order
    assert saving([(6, 0.9), (5, 0.99)], residents, 0, 2, 1.0, 0.2, 0.3) == [(5, 2), (6, 1)]
    assert saving([(6, 0.9), (5, 0.99)], residents, 0, 2, 1.0, 0.35, 0.3) == [(5, 2)]  # 0.9 - 0.35 - 0.6 < 0
    assert saving([(6, 0.9), (5, 0.99)], residents, 1, 2, 1.0, 0.2, 0.3) == [(5, None), (6, 2)]  # free slot first
    assert saving([(6, 0.9), (5, 0.99)], residents, 1, 1, 1.0, 0.2, 0.3) == [(5, None)]  # the limit
    assert take_all([(6, 0.1), (5, 0.99)], residents, 0, 1, 1.0, 0.9, 0.3) == [(6, None)]  # `all`: mass order, no test


@pytest.mark.timeout(10)
def test_calibration_starts_at_the_bin_and_follows_what_happens():
    assert [mass_bin(m) for m in (0.0, 0.05, 0.55, 0.999, 1.0, 2.5, 9.0)] == [0, 0, 5, 9, 10, 11, 12]
    cal = Calibration(decay=0.99)
    key = ("pred", 9, False)
    assert cal.p(key) == pytest.approx(0.95) and cal.p(("cached", 0, True)) == pytest.approx(0.2)
    for i in range(2000):  # a top-1 weight of 0.9+ that is right only a third of the time
        cal.observe(key, i % 3 == 0)
    assert cal.p(key) == pytest.approx(1 / 3, abs=0.03)
    assert "pred9" in cal.describe()


# ------------------------------------------------------------------ the store acting on it
def _step(store, ids):
    x, ids_TK = torch.zeros(1, D), torch.tensor([ids])
    store.fetch(x, ids_TK).run(x, ids_TK, torch.ones(1, len(ids)), _checking_compute(store, ids_TK, set()))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("weight,copied", [(0.95, True), (0.35, False)])
def test_the_store_prefetches_a_sure_prediction_over_a_recent_expert_and_keeps_it_for_a_weak_one(weight, copied):
    torch.set_num_threads(1)
    m, (first, second), routers = _stores(2, 6, 1, 1, miss_policy="wait", prefetch_rule="saving")
    m.prefetcher.costs = lambda: (1.0, 0.5)  # miss_s, busy * copy_s: a half-busy link
    routers[1].ids_TK, routers[1].weights_TK = torch.tensor([[0]]), torch.tensor([[1.0]])
    for _ in range(2):  # expert 0 of the second layer: used, cached, recent
        _step(first, [4])
        _step(second, [0])
    assert second.table.lookup(0) is not None
    routers[1].ids_TK, routers[1].weights_TK = torch.tensor([[3]]), torch.tensor([[weight]])
    _step(first, [4])
    p_c, p_v = (m.prefetcher.calibration.p(k) for k in (("pred", mass_bin(weight), False), ("cached", 0, True)))
    assert (p_c - 0.5 - p_v > 0) == copied  # the rule's arithmetic, with the priors
    st = m.stats[1]
    if copied:
        assert second.prefetched == {3} and second.evicted == {0} and second.table.lookup(0) is None
    else:
        assert second.prefetched == set() and second.table.lookup(0) is not None and st.prefetch_declined == 1
    _step(second, [0])  # the layer needs the recent expert after all
    assert st.prefetch_evicted_needed == int(copied) and st.prefetch_wasted == int(copied)


# ------------------------------------------------------------------ the CPU replay
@pytest.mark.timeout(120)
def test_replay_runs_the_engine_decisions_and_the_new_rule_wastes_less():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from offload_parts import TraceReplay, record_tiny_traces
    from offload_replay import MIXTRAL_EXPERT_BYTES, replay

    torch.set_num_threads(1)
    traces = TraceReplay(record_tiny_traces(2, 64, torch.device("cpu")), 8, 2, "cpu")
    args = argparse.Namespace(streams=1, steps=16, gpu_slots=56, link_gbps=54.4, cpu_ms=9.0, cpu13_share=0.57,
                              host_ms=2.7, gpu_ms=0.5)
    old = replay(OffloadConfig(store="cpu", prefetch_rule="all"), traces, [0], args)
    new = replay(OffloadConfig(store="cpu", prefetch_rule="saving"), traces, [0], args)
    for r in (old, new):
        assert 0 < r["hit_rate"] < 1 and r["gb_wasted_per_step"] <= r["gb_per_step"]
        prefetched_gb = r["prefetched_per_step"] * MIXTRAL_EXPERT_BYTES / 1e9
        assert r["gb_misses_per_step"] + prefetched_gb == pytest.approx(r["gb_per_step"])
    assert old["prefetched_per_step"] > 20  # the old rule copies about one expert per layer and step
    assert new["gb_wasted_per_step"] < 0.5 * old["gb_wasted_per_step"]
    assert new["gb_per_step"] < old["gb_per_step"] and new["evicted_needed_per_step"] < old["evicted_needed_per_step"]
