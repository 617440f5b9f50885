"""The offload cache's bookkeeping: slot tables, policies, the planner's errors, the miss split, and
(property test) that a step never computes with a slot that does not hold its expert's weights:
nothing the running step or an in-flight prefetch needs is ever evicted."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_infer.config import OffloadConfig
from moe_infer.offload import ExpertShape, OffloadedExpertStore, OffloadManager, plan_offload
from moe_infer.offload.cost import CostModel, split_misses
from moe_infer.offload.policies import CACHE_POLICIES
from moe_infer.offload.slots import SlotTable
from moe_infer.offload.split import MissPlan, granule, plan_misses

D, F = 4, 2


# ------------------------------------------------------------------ slot table
@settings(max_examples=200, deadline=None)
@given(num_slots=st.integers(0, 4), policy=st.sampled_from(["lru", "lfu"]),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "alloc_victim", "pin_step", "pin_prefetch", "unpin_step",
                                               "unpin_prefetch", "touch", "observe"]), st.integers(0, 7)),
                    max_size=60))
def test_slot_table_never_evicts_a_pinned_key(num_slots, policy, ops):
    table = SlotTable(num_slots, CACHE_POLICIES.get(policy)())
    for op, key in ops:
        if op.startswith("alloc") and table.lookup(key) is None:
            pinned_before = {k for k in table.slot_of if table.is_pinned(k)}
            victim = None
            if op == "alloc_victim" and table.slot_of:  # the prefetch rule names its victim: the oldest key
                victim = next(iter(table.slot_of))
                if victim in pinned_before:
                    with pytest.raises(ValueError, match="pinned"):
                        table.allocate(key, victim)
                    continue
            got = table.allocate(key, victim)
            if got is None:  # refused only when every slot holds a pinned key
                assert len(pinned_before) == num_slots
                continue
            slot, evicted = got
            assert evicted not in pinned_before
            if victim is not None:
                assert evicted == victim
            assert table.lookup(key) == slot and table.key_in[slot] == key
        elif op.startswith("pin_"):
            table.pin(key, op[4:])
        elif op.startswith("unpin_"):
            table.unpin_all(op[6:])
        elif op == "touch":
            table.touch(key)
        elif op == "observe":
            table.policy.observe({key: 3})
        assert len(table.slot_of) <= num_slots
        assert all(table.key_in[s] == k for k, s in table.slot_of.items())


def test_lru_evicts_the_least_recent_and_lfu_keeps_the_hot():
    lru = SlotTable(2, CACHE_POLICIES.get("lru")())
    lru.allocate(0), lru.allocate(1)
    lru.touch(0)
    assert lru.allocate(2) == (1, 1)  # expert 1 was used least recently
    lfu = SlotTable(2, CACHE_POLICIES.get("lfu")())
    lfu.allocate(0), lfu.allocate(1)
    lfu.policy.observe({0: 50, 1: 1})
    lfu.touch(1)  # recent, but cold
    assert lfu.allocate(2) == (1, 1)


# ------------------------------------------------------------------ planner
def _shape(L=4, E=8, K=2, dtype=torch.bfloat16):
    return ExpertShape(num_layers=L, num_local_experts=E, top_k=K, hidden_size=64, intermediate_size=32, dtype=dtype)


def test_plan_spreads_the_budget_and_refuses_an_impossible_one(tmp_path):
    shape = _shape()
    per = shape.nbytes / 2**30
    plan = plan_offload(OffloadConfig(store="cpu", gpu_expert_budget_gb=per * 11), shape)
    assert plan.stream_chunk == 1 and plan.slots_per_layer == [3, 2, 2, 2]  # 11 - 2 stream slots = 9
    with pytest.raises(ValueError, match="gpu_expert_budget_gb=.* holds 1 experts.*at least 2"):
        plan_offload(OffloadConfig(store="cpu", gpu_expert_budget_gb=per * 1.5), shape)
    with pytest.raises(ValueError, match="cache_policy='fifo'"):
        plan_offload(OffloadConfig(store="cpu", cache_policy="fifo"), shape)
    with pytest.raises(ValueError, match=r"prefetch_rule='sometimes' is not one of \['all', 'saving'\]"):
        plan_offload(OffloadConfig(store="cpu", prefetch_rule="sometimes"), shape)
    with pytest.raises(ValueError, match="cpu_budget_gb=.* at least two layers"):
        plan_offload(OffloadConfig(store="nvme", nvme_path=str(tmp_path), cpu_budget_gb=per * 10), shape)


def test_plan_refuses_a_bad_nvme_path(tmp_path, monkeypatch):
    shape = _shape()
    with pytest.raises(ValueError, match="is not a directory"):
        plan_offload(OffloadConfig(store="nvme", nvme_path=str(tmp_path / "missing")), shape)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.setattr("os.access", lambda path, mode: False)
    with pytest.raises(ValueError, match="not readable and writable"):
        plan_offload(OffloadConfig(store="nvme", nvme_path=str(locked)), shape)
    monkeypatch.undo()
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(ValueError, match="GiB free; the experts need"):
        plan_offload(OffloadConfig(store="nvme", nvme_path=str(tmp_path)), shape)
    with pytest.raises(ValueError, match="needs offload.nvme_path"):
        OffloadConfig(store="nvme")


class _TimedEvent:
    """A CUDA event as the copier sees it: done or not, recorded at t ms."""

    def __init__(self, done: bool, t_ms: float) -> None:
        self.done, self.t_ms = done, t_ms

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_TimedEvent") -> float:
        return end.t_ms - self.t_ms


def test_the_link_backlog_follows_the_copies_themselves():
    """The copier's backlog is the bandwidth estimate or the copies not yet done (the one under way as
    half done), whichever is more; each finished large copy's measured time moves the link rate, and
    the manager's cost model takes that rate for its next split."""
    from moe_infer.offload.copier import Copier

    c = Copier(torch.device("cpu"))
    c.bytes_per_s, c.clock = 50e9, lambda: 0.0  # by the bandwidth estimate the link is idle
    mb352 = 352_000_000
    c.pending.extend([(_TimedEvent(True, 0.0), _TimedEvent(True, 8.0), mb352),  # done: 44 GB/s
                      (_TimedEvent(True, 8.0), _TimedEvent(True, 8.01), 4096),  # done, small: not timed
                      (_TimedEvent(True, 8.0), _TimedEvent(False, 0.0), mb352),  # under way
                      (_TimedEvent(False, 0.0), _TimedEvent(False, 0.0), mb352)])  # queued
    wait = c.seconds_until_idle()
    rate = 50e9 + 0.05 * (44e9 - 50e9)
    assert c.bytes_per_s == pytest.approx(rate)
    assert wait == pytest.approx(1.5 * mb352 / rate) and len(c.pending) == 2
    c.link_free_at = 0.1  # a backlog the estimate knows of, longer than the copies': that one
    assert c.seconds_until_idle() == pytest.approx(0.1)
    for _, end, _ in c.pending:
        end.done = True
    c.link_free_at = 0.0
    assert c.seconds_until_idle() == 0.0 and not c.pending
    m, _, _ = _stores(2, 4, 2, 1)
    m.copier.pending.append((_TimedEvent(True, 0.0), _TimedEvent(True, 1.0), 1 << 21))  # 2 MiB in 1 ms
    m.copier.rate_weight = 1.0
    m.link_wait_s()
    assert m.cost.h2d_bytes_per_s == pytest.approx((1 << 21) / 1e-3)


def test_the_host_lead_is_noted_once_per_layer_step():
    """An EP dispatcher may run one layer step's rows in parts (two `run` calls): only the first part's
    start of host compute is the lead; the second starts after the first part's host compute."""
    torch.set_num_threads(1)
    m, (store, _), routers = _stores(2, 4, 2, 0, miss_policy="cpu")
    routers[1].ids_TK, routers[1].weights_TK = torch.tensor([[0, 1]]), torch.ones(1, 2)
    leads = []
    m.note_host_lead = leads.append
    x_TD, ids_TK = torch.randn(1, D), torch.tensor([[2, 3]])
    fetched = store.fetch(x_TD, ids_TK)
    for _ in range(2):
        fetched.run(x_TD, ids_TK, torch.ones(1, 2), _checking_compute(store, ids_TK, set()))
    assert len(leads) == 1 and leads[0] >= 0


def test_split_misses_balances_link_and_cpu():
    cost = CostModel(h2d_bytes_per_s=1e9, cpu_seconds_at=((1, 4e-3), (4, 4e-3), (16, 8e-3), (64, 30e-3)))
    expert = int(6.5e6)  # 6.5 ms on the link
    assert split_misses({3: 1, 5: 1}, "auto", cost, expert, 0.0) == ([5], [3])  # one each: 6.5 ms, not 13
    assert split_misses({3: 64}, "auto", cost, expert, 0.0) == ([3], [])  # 30 ms on the CPU: copy
    assert split_misses({3: 1}, "auto", cost, expert, 0.010) == ([], [3])  # the link is busy for 10 ms
    assert split_misses({3: 1, 5: 2}, "wait", cost, expert, 0.0) == ([3, 5], [])
    assert split_misses({3: 1, 5: 2}, "cpu", cost, expert, 0.0) == ([], [3, 5])
    # the host starts its experts 3 ms late (it launches the device's part first): 7 ms, so the link
    # takes the first miss (6.5 ms against 7) and the host the second (7 ms against 13)
    assert split_misses({3: 1, 5: 1}, "auto", cost, expert, 0.0, cpu_lead_s=3e-3) == ([3], [5])
    # 9 ms late: both on the link (13 ms against 9 + 4)
    assert split_misses({3: 1, 5: 1}, "auto", cost, expert, 0.0, cpu_lead_s=9.5e-3) == ([3, 5], [])


def test_plan_misses_shares_an_expert_between_the_link_and_the_host():
    """A Mixtral expert on the H100 host (benchmarks/results/trials/offload_split_limits_*.log): the link
    6.5 ms for the whole expert, the host 6.6 ms whole and 3.7 ms for its gate/up projections alone, at
    one row. Shared, both end together near 3 ms instead of 6.5."""
    shape = ExpertShape(1, 8, 2, 4096, 14336, torch.bfloat16)
    F = shape.intermediate_size
    cost = CostModel(shape.nbytes / 6.5e-3, ((1, 6.6e-3), (64, 30e-3)), cpu13_seconds_at=((1, 3.7e-3), (64, 20e-3)))
    link_s = lambda c: 6.5e-3 / 3 + (F - c) / F * 6.5e-3 * 2 / 3  # noqa: E731  w2 and the rest of gate/up
    host_s = lambda c, t=3.7e-3: c / F * t  # noqa: E731
    p = plan_misses({3: 1}, {}, "share", cost, shape, 0.0)
    c = c0 = p.shared[3]
    assert p.to_copy == p.to_cpu == [] and c % granule(shape) == 0
    assert abs(link_s(c) - host_s(c)) < 0.1e-3 and max(link_s(c), host_s(c)) < 3.05e-3
    # two misses: the host takes rows of the expert with fewer routed rows first, then of the other
    p = plan_misses({3: 4, 5: 1}, {}, "share", cost, shape, 0.0)
    assert p.shared[5] == F and 0 < p.shared[3] < F
    # a slot that lacks its first m rows shares just those: no w2 on the link
    m = F // 2
    p = plan_misses({}, {6: (1, m)}, "share", cost, shape, 0.0)
    c = p.shared[6]
    assert abs((m - c) / F * 6.5e-3 * 2 / 3 - host_s(c)) < 0.1e-3
    # the host launches the next layers for 3.5 ms while the link copies: the link's credit, the host's less
    p = plan_misses({3: 1}, {}, "share", cost, shape, -3.5e-3)
    c = p.shared[3]
    assert abs(link_s(c) - 3.5e-3 - host_s(c)) < 0.1e-3 and 0.3 < c / F < 0.45
    # the host's compute starts 1.5 ms late: it takes fewer rows, both still end together
    p = plan_misses({3: 1}, {}, "share", cost, shape, 0.0, cpu_lead_s=1.5e-3)
    assert abs(link_s(p.shared[3]) - 1.5e-3 - host_s(p.shared[3])) < 0.1e-3 and p.shared[3] < c0
    # a link busy for 30 ms: the whole expert on the host (it spares the link w2 as well)
    assert plan_misses({3: 1}, {}, "share", cost, shape, 0.030) == MissPlan([], [3], {})
    # the other policies never share a missed expert; a partial slot is completed by the link (or the host)
    assert plan_misses({3: 1, 5: 1}, {6: (1, m)}, "auto", cost, shape, 0.0) == MissPlan([3], [5], {6: 0})
    assert plan_misses({3: 1}, {6: (1, m)}, "wait", cost, shape, 0.0) == MissPlan([3], [], {6: 0})
    assert plan_misses({3: 1}, {6: (1, m)}, "cpu", cost, shape, 0.0) == MissPlan([], [3], {6: m})


def test_host_gap_is_the_averaged_host_time_between_layer_steps():
    m, _, _ = _stores(1, 4, 1, 1)
    m.note_host_gap(5.0)  # no layer step ended before: nothing to average
    assert m.host_gap_s == 0.0
    m.run_end_s = 1.0
    m.note_host_gap(1.004)
    assert m.host_gap_s == pytest.approx(0.1 * 0.004) and m.run_end_s is None
    m.run_end_s = 2.0
    m.note_host_gap(9.0)  # a long pause (between requests) counts as the cap, 50 ms
    assert m.host_gap_s == pytest.approx(0.9 * 0.0004 + 0.1 * 0.05)


def test_cpu_cost_follows_what_the_engine_measures():
    """The start-up CPU figures are rescaled by the CPU path's measured time: a host that turns out 3x
    slower in the running engine stops getting the misses the quiet measurement gave it."""
    cost = CostModel(h2d_bytes_per_s=1e9, cpu_seconds_at=((1, 4e-3), (4, 4e-3), (16, 8e-3), (64, 30e-3)))
    expert = int(6.5e6)
    assert split_misses({3: 1}, "auto", cost, expert, 0.0) == ([], [3])  # 4 ms < 6.5 ms
    for _ in range(30):
        cost.observe_cpu([1, 1], 3 * 8e-3)  # two 1-row experts took 24 ms, predicted 8 ms
    assert abs(cost.cpu_scale - 3.0) < 0.01
    assert abs(cost.cpu_seconds(4) - 12e-3) < 1e-4
    assert split_misses({3: 1}, "auto", cost, expert, 0.0) == ([3], [])  # 12 ms > 6.5 ms: copy
    for _ in range(30):
        cost.observe_cpu([16], 4e-3)  # now twice as fast as at start-up
    assert abs(cost.cpu_scale - 0.5) < 0.01
    assert split_misses({3: 1}, "auto", cost, expert, 0.0) == ([], [3])
    cost.observe_cpu([], 1.0)  # nothing predicted: no change
    assert abs(cost.cpu_scale - 0.5) < 0.01
    assert "x0.50 as measured in the engine" in cost.describe(expert)
    cost.cpu_scale = 3.0
    for _ in range(69):  # layer steps with nothing on the host: the excess over 1 halves
        cost.relax()
    assert cost.cpu_scale == pytest.approx(1.0 + 2.0 * 0.99 ** 69) and 1.95 < cost.cpu_scale < 2.05


# ------------------------------------------------------------------ the store's bookkeeping
class _Router:
    """The pre-gate a store's router gives: set by the test before each step."""

    def __init__(self, K: int) -> None:
        self.ids_TK = self.weights_TK = None
        self.K = K

    def __call__(self, x_TD):
        return None, self.weights_TK, self.ids_TK


def _stores(L, E, K, slots, nvme_dir=None, **cfg):
    """L stores of E experts over one manager: the CPU tier, or with nvme_dir the NVMe tier with the
    smallest host cache it allows (two layers' experts and one); there each store keeps the weights it
    was loaded with as plain tensors (w13_E2FD, w2_EDF) for the checks, as the load maps are dropped."""
    shape = ExpertShape(L, E, K, D, F, torch.float32)
    if nvme_dir is not None:
        cfg = dict(cfg, store="nvme", nvme_path=nvme_dir, nvme_reader="threads",
                   cpu_budget_gb=(min(2 * E + 1, L * E) * shape.record_bytes + 1) / 2**30)
    cfg = OffloadConfig(**{"store": "cpu", **cfg}, slots_per_layer=slots)
    m = OffloadManager(cfg, plan_offload(cfg, shape), torch.device("cpu"))
    routers = [_Router(K) for _ in range(L)]
    stores = [OffloadedExpertStore(E, D, F, torch.float32, manager=m, router=r) for r in routers]
    refs = []
    for i, s in enumerate(stores):  # every expert's weights unique
        s.w13_E2FD.copy_(torch.arange(s.w13_E2FD.numel()).view_as(s.w13_E2FD) + 1000.0 * i)
        s.w2_EDF.copy_(-torch.arange(s.w2_EDF.numel()).view_as(s.w2_EDF) - 1000.0 * i)
        refs.append((s.w13_E2FD.clone(), s.w2_EDF.clone()))
    m.finish_load()
    if nvme_dir is not None:
        assert m.plan.host_slots == min(2 * E + 1, L * E)
        for s, (w13, w2) in zip(stores, refs):
            s.w13_E2FD, s.w2_EDF = w13, w2
    return m, stores, routers


def _checking_compute(store, ids_TK, seen):
    """The slot compute of a step, checking that each row's slot holds its expert: w2 and the gate/up
    rows past the slot's missing ones equal to the host tier's, the missing ones zero (the host computes
    those, offload/split.py). Returns out_TD by a naive loop over the rows."""
    def compute(x_TD, slot_ids_TK, weights_TK, w13_S2FD, w2_SDF):
        out_TD = torch.zeros_like(x_TD)
        for (t, k), slot in zip(torch.nonzero(slot_ids_TK >= 0).tolist(), slot_ids_TK[slot_ids_TK >= 0].tolist()):
            e = int(ids_TK[t, k])
            miss = store.missing_S[slot] if w13_S2FD is store.w13_S2FD else 0  # stream buffers hold whole experts
            w13, ref13 = w13_S2FD[slot], store.w13_E2FD[e]
            rows = torch.cat([torch.arange(miss, F), torch.arange(F + miss, 2 * F)])
            zero = torch.cat([torch.arange(0, miss), torch.arange(F, F + miss)])
            assert torch.equal(w13[rows], ref13[rows]) and torch.equal(w2_SDF[slot], store.w2_EDF[e]) and \
                not w13[zero].any(), f"layer {store.pos} expert {e} computed from a slot that holds something else"
            seen.add((t, k))
            out_TD[t] += weights_TK[t, k] * _swiglu_ref(x_TD[t], w13, w2_SDF[slot])
        return out_TD

    return compute


def _swiglu_ref(x_D, w13_2FD, w2_DF):
    h_2F = w13_2FD @ x_D
    return w2_DF @ (torch.nn.functional.silu(h_2F[:F]) * h_2F[F:])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), E=st.integers(2, 6), K=st.integers(1, 2), slots=st.integers(0, 4),
       miss=st.sampled_from(["wait", "cpu", "auto", "share"]), policy=st.sampled_from(["lru", "lfu"]),
       stream_fraction=st.sampled_from([0.3, 0.75, 1.0]), steps=st.integers(1, 8),
       rule=st.sampled_from(["all", "saving"]), min_prob=st.sampled_from([0.0, 0.3, 0.9]),
       link_s=st.sampled_from([0.0, 0.5]), cpu_ms=st.sampled_from([1.0, 4.0, 20.0]), local=st.booleans(),
       nvme=st.booleans())
def test_every_step_computes_with_the_right_weights(data, E, K, slots, miss, policy, stream_fraction, steps, rule,
                                                    min_prob, link_s, cpu_ms, local, nvme):
    """Any sequence of steps: each row on the device reads a slot that holds its expert (but for the
    gate/up rows the host computes), and each step's output equals the experts computed from the
    host tier by a naive loop, whichever mix of hits, partial slots, copies, shared misses, streams
    and host experts the cost model picks (a 6.5 ms link; the host cpu_ms an expert); through `run` (any
    rows, device-side slot lookups) or `run_local` (fetch's rows, slot ids looked up on the host); with
    the CPU tier, or the NVMe tier behind the smallest host cache (reads, host-cache evictions, pins)."""
    import shutil
    import tempfile

    torch.set_num_threads(1)
    nvme_dir = tempfile.mkdtemp(prefix="offload_prop_") if nvme else None
    try:
        _check_steps(data, E, K, slots, miss, policy, stream_fraction, steps, rule, min_prob, link_s, cpu_ms, local,
                     nvme_dir)
    finally:
        if nvme_dir is not None:
            shutil.rmtree(nvme_dir, ignore_errors=True)


def _check_steps(data, E, K, slots, miss, policy, stream_fraction, steps, rule, min_prob, link_s, cpu_ms, local,
                 nvme_dir):
    L = 3 if nvme_dir is None else 4  # NVMe: more layers than the host cache holds
    m, stores, routers = _stores(L, E, K, slots, nvme_dir, miss_policy=miss, cache_policy=policy,
                                 stream_fraction=stream_fraction, prefetch_rule=rule, prefetch_min_prob=min_prob)
    m.cost = CostModel(m.shape.nbytes / 6.5e-3, ((1, cpu_ms * 1e-3), (64, 4 * cpu_ms * 1e-3)))
    m.prefetcher.costs = lambda: (1.0, link_s)  # an idle or a half-busy link, not the wall clock
    m.copier.clock = lambda: 0.0  # the link's backlog as the test sets it, not as the wall clock drains it
    m.note_host_gap = lambda now: None  # no credit for the host's own time (the backlog alone decides)
    ids = st.lists(st.integers(-1, E - 1), min_size=K, max_size=K)
    weights = st.lists(st.floats(0.0, 1.0), min_size=K, max_size=K)
    for _ in range(steps):
        T = data.draw(st.integers(1, 4))
        for layer, store in enumerate(stores):
            m.copier.link_free_at = data.draw(st.sampled_from([0.0, 0.003, 0.03]))
            ids_TK = torch.tensor(data.draw(st.lists(ids, min_size=T, max_size=T)))
            weights_TK = torch.tensor(data.draw(st.lists(weights, min_size=T, max_size=T)))
            if layer + 1 < L:
                routers[layer + 1].ids_TK = torch.tensor(data.draw(st.lists(ids, min_size=T, max_size=T))).clamp_min(0)
                routers[layer + 1].weights_TK = torch.tensor(data.draw(st.lists(weights, min_size=T, max_size=T)))
            prefetched = set(store.prefetched)
            hits_before = m.stats[layer].prefetch_hits
            x_TD = torch.randn(T, D) / 1e3
            fetched = store.fetch(x_TD, ids_TK)
            needed = {e for e in ids_TK.view(-1).tolist() if e >= 0}
            assert m.stats[layer].prefetch_hits - hits_before == len(prefetched & needed)  # none was evicted
            assert set(fetched.to_cpu) | set(fetched.to_stream) | {e for e in needed if store.table.lookup(e) is not None} >= needed
            seen = set()
            check = _checking_compute(store, ids_TK, seen)
            out_TD = (fetched.run_local(x_TD, weights_TK, check) if local else
                      fetched.run(x_TD, ids_TK, weights_TK, check))
            elsewhere = set(fetched.to_cpu)
            want = {(t, k) for t in range(T) for k in range(K) if ids_TK[t, k] >= 0 and int(ids_TK[t, k]) not in elsewhere}
            assert seen == want  # every row on the device ran from a slot holding its expert
            ref_TD = torch.zeros(T, D)
            for t, k in torch.nonzero(ids_TK >= 0).tolist():
                e = int(ids_TK[t, k])
                ref_TD[t] += weights_TK[t, k] * _swiglu_ref(x_TD[t], store.w13_E2FD[e], store.w2_EDF[e])
            torch.testing.assert_close(out_TD, ref_TD, rtol=1e-4, atol=1e-3)
            if nvme_dir is not None:  # the host cache holds pins for the next layer's prefetch at most
                assert {key[0] for key in m.host_table.pins["prefetch"]} <= {layer + 1}, m.host_table.pins
    total = m.summary()["total"]
    assert total["needed"] == (total["hits"] + total["partial"] + total["copied"] + total["shared"]
                               + total["streamed"] + total["cpu"])
    assert total["prefetch_hits"] + total["prefetch_wasted"] == total["prefetched"] - sum(
        len(s.prefetched) for s in stores)  # every landed prefetch was used or wasted (the last ones are pending)
    if miss in ("wait", "auto"):
        assert total["shared"] == total["partial"] == 0
    if nvme_dir is not None:
        assert total["gb_read"] > 0
        m.close()


@pytest.mark.parametrize("rule", ["all", "saving"])
def test_a_prefetch_never_evicts_what_it_just_brought(rule):
    """LFU ranks a just-prefetched (never routed) expert coldest: without the prefetch pin the next
    prefetched expert would take its slot, and the layer would miss what was predicted right."""
    torch.set_num_threads(1)
    m, (first, second), routers = _stores(2, 6, 2, 2, cache_policy="lfu", miss_policy="wait", prefetch_rule=rule)
    m.prefetcher.costs = lambda: (1.0, 0.0)  # an idle link: `saving` takes every likelier candidate
    x = torch.zeros(1, D)
    for _ in range(3):  # experts 0 and 1 of the second layer become hot and cached
        routers[1].ids_TK = torch.tensor([[0, 1]])
        first.fetch(x, torch.tensor([[0, 1]])).run(x, torch.tensor([[0, 1]]), torch.ones(1, 2), _checking_compute(first, torch.tensor([[0, 1]]), set()))
        second.fetch(x, torch.tensor([[0, 1]])).run(x, torch.tensor([[0, 1]]), torch.ones(1, 2), _checking_compute(second, torch.tensor([[0, 1]]), set()))
    routers[1].ids_TK = torch.tensor([[2, 3]])  # the pre-gate now says 2 and 3
    first.fetch(x, torch.tensor([[0, 1]])).run(x, torch.tensor([[0, 1]]), torch.ones(1, 2), _checking_compute(first, torch.tensor([[0, 1]]), set()))
    assert second.prefetched == {2, 3}
    before = m.stats[1].summary()
    second.fetch(x, torch.tensor([[2, 3]]))
    after = m.stats[1].summary()
    assert after["prefetch_hits"] - before["prefetch_hits"] == 2 and after["copied"] == before["copied"]


@pytest.mark.parametrize("ids,weights,expected", [
    ([[1, 3]], [[0.2, 0.8]], 3),  # the router's weights: the likelier expert, not the lower id
    ([[3, 1]], None, 3),  # no weights (a replayed trace): the pre-gate's first pick
    ([[0, 2], [2, 0]], [[0.4, 0.6], [0.7, 0.3]], 2),  # summed over tokens: 1.3 for 2, 0.7 for 0 (2 rows each)
])
def test_a_layer_with_fewer_slots_than_predictions_prefetches_the_likeliest(ids, weights, expected):
    torch.set_num_threads(1)
    m, (first, second), routers = _stores(2, 6, 2, 1, miss_policy="wait", prefetch_rule="all")
    x = torch.zeros(len(ids), D)
    routers[1].ids_TK = torch.tensor(ids)
    routers[1].weights_TK = None if weights is None else torch.tensor(weights)
    ids_TK = torch.tensor([[4, 5]] * len(ids))
    first.fetch(x, ids_TK).run(x, ids_TK, torch.ones(len(ids), 2), _checking_compute(first, ids_TK, set()))
    assert second.prefetched == {expected}


def test_a_layer_step_that_fails_part_way_still_has_its_pins_released(monkeypatch):
    """The next layer step releases every step pin, also those of a step that raised after pinning
    (e.g. an NVMe host cache that is full): otherwise those experts stay pinned for good."""
    torch.set_num_threads(1)
    m, (first, second), _ = _stores(2, 6, 1, 2, miss_policy="wait", prefetch=False)
    x = torch.zeros(1, D)

    def full(*args):
        raise RuntimeError("the host cache's slots are all pinned")

    monkeypatch.setattr(m, "ensure_host", full)
    with pytest.raises(RuntimeError, match="all pinned"):
        first.fetch(x, torch.tensor([[3]]))
    assert first.table.pins["step"] == {3}
    monkeypatch.undo()
    second.fetch(x, torch.tensor([[0]]))
    assert first.table.pins["step"] == set()


def test_host_tier_stays_on_the_host_when_the_model_is_built_under_a_device_context(tmp_path):
    """load_model builds the model under `with torch.device(device)`: the host tier (and the NVMe file
    maps) must still be host memory; a device context on a CPU-only machine is simulated with meta."""
    for store in ("cpu", "nvme"):
        cfg = OffloadConfig(store=store, slots_per_layer=1, nvme_path=str(tmp_path))
        m = OffloadManager(cfg, plan_offload(cfg, ExpertShape(1, 4, 2, D, F, torch.float32)), torch.device("cpu"))
        with torch.device("meta"):
            s = OffloadedExpertStore(4, D, F, torch.float32, manager=m, router=_Router(2))
        assert s.w13_E2FD.device.type == "cpu" and s.w2_EDF.device.type == "cpu", store
        m.close()


def test_a_single_moe_layer_releases_its_step_pins_between_steps():
    """With one MoE layer no other layer's fetch comes between two of its steps: its own fetch must
    release the previous step's pins, or the cache freezes (every later miss streams)."""
    torch.set_num_threads(1)
    m, (store,), _ = _stores(1, 6, 1, 2, miss_policy="wait")
    x = torch.zeros(1, D)
    for e in range(6):
        ids = torch.tensor([[e]])
        store.fetch(x, ids).run(x, ids, torch.ones(1, 1), _checking_compute(store, ids, set()))
    total = m.summary()["total"]
    assert total["copied"] == 6 and total["streamed"] == 0
