"""The offload cost model: what the link and the host cores cost and when each is free. The link's
backlog from the copies themselves, the host's lead and gap, the CPU scale, and the miss split
(`split_misses`, and `plan_misses` with shared experts)."""
from __future__ import annotations

import time

import pytest
import torch

from moe_infer.offload import ExpertShape
from moe_infer.offload.cost import CostModel, split_misses
from moe_infer.offload.split import MissPlan, granule, plan_misses
from test_offload_cache import D, _checking_compute, _stores


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


def test_a_long_host_lead_does_not_stick_when_every_miss_goes_to_the_link():
    """Only host expert compute measures the lead: layer steps whose misses all go to the link move it back
    toward 0 (1 % each), so a lead measured long once does not keep the host cores idle for good."""
    m, (store, _), _ = _stores(2, 4, 2, 1, miss_policy="auto", prefetch=False)
    m.cost.cpu_seconds_at = ((1, 1.0), (64, 1.0))  # a slow host: every miss goes to the link
    m.host_lead_s = lead = 0.02
    x_TD = torch.randn(1, D)
    for step in range(3):
        ids_TK = torch.tensor([[step % 4, (step + 1) % 4]])
        store.fetch(x_TD, ids_TK).run(x_TD, ids_TK, torch.ones(1, 2), _checking_compute(store, ids_TK, set()))
        assert m.host_lead_s < lead
        lead = m.host_lead_s
    assert m.host_lead_s == pytest.approx(0.02 * 0.99 ** 3)


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
    """A Mixtral expert on the H100 host (34e25c7:benchmarks/results/trials/offload_split_limits_*.log, docs/notes/removed.md): the link
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


def test_host_gap_leaves_out_the_time_between_two_forwards():
    """The gap before the first MoE layer of a forward holds the end of the last forward (the head,
    sampling, scheduling): not the host's time between two layer steps, so not averaged."""
    m, stores, routers = _stores(3, 4, 2, 1, miss_policy="auto", prefetch=False)
    x_TD = torch.randn(1, D)
    gaps = []
    for layer in (0, 1, 2, 0, 1):
        ids_TK = torch.tensor([[layer, layer + 1]])
        before = m.host_gap_s
        stores[layer].fetch(x_TD, ids_TK).run(x_TD, ids_TK, torch.ones(1, 2),
                                              _checking_compute(stores[layer], ids_TK, set()))
        gaps.append(m.host_gap_s != before)
        time.sleep(0.01)  # the host's own time after each layer step
    assert gaps == [False, True, True, False, True]
    assert 0.01 * 0.1 < m.host_gap_s < 0.05


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
