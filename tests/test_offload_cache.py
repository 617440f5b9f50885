"""The offload cache's bookkeeping: slot tables, policies, the planner's errors, and
(property test) that a step never computes with a slot that does not hold its expert's weights:
nothing the running step or an in-flight prefetch needs is ever evicted."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_infer.config import OffloadConfig
from moe_infer.offload import ExpertShape, OffloadedExpertStore, OffloadManager, plan_offload
from moe_infer.offload.cost import CostModel
from moe_infer.offload.policies import CACHE_POLICIES
from moe_infer.offload.slots import SlotTable

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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pin", "unpin_all", "allocate", "victim"]),
                          st.sampled_from(["step", "prefetch"]), st.integers(0, 9)), max_size=80))
def test_slot_table_pins_match_a_naive_scan(ops):
    """is_pinned / evictable / allocate against a scan over the pin sets of every kind (the reference),
    through any mix of pins, releases and allocations: a pinned key is never evicted."""
    table = SlotTable(4, CACHE_POLICIES.get("lru")())
    for op, kind, key in ops:
        if op == "pin":
            table.pin(key, kind)
        elif op == "unpin_all":
            table.unpin_all(kind)
        elif key not in table.slot_of:
            pinned_before = {k for pins in table.pins.values() for k in pins}
            victim = None
            if op == "victim":
                free = [k for k in table.slot_of if k not in pinned_before]
                victim = free[0] if free and not table.free else None
            got = table.allocate(key, victim)
            if got is not None and got[1] is not None:
                assert got[1] not in pinned_before
        for k in range(10):
            assert table.is_pinned(k) == any(k in pins for pins in table.pins.values()), (k, table.pins)
        naive = [k for k in table.slot_of if not any(k in pins for pins in table.pins.values())]
        assert table.evictable() == naive


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
    m.note_host_gap = lambda *_: None  # no credit for the host's own time (the backlog alone decides)
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
