"""Attention data parallelism on the host: the replicas' schedulers (DPScheduler) and the padding of each replica's
part of a step to common sizes (dp_lay_out), without a model."""
from __future__ import annotations

import numpy as np
import pytest

from moe_infer.engine.dp_inputs import dp_lay_out
from moe_infer.engine.dp_scheduler import DPScheduler
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.engine.sequence import Sequence
from moe_infer.engine.step_inputs import decode_inputs, flat_inputs, host_segments

pytestmark = pytest.mark.timeout(60)

KW = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, eos_token_ids=[2])


def req(n, first, max_tokens=4):
    return Sequence(f"r{first}", list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s, token=7):
    plan = s.schedule()
    s.postprocess(plan, [token if item.do_sample else None for item in plan.seqs])
    return plan


def test_requests_spread_and_stay_on_their_replica():
    s = DPScheduler(2, num_blocks=5, block_size=4, enable_prefix_caching=True, **KW)
    seqs = [req(6, 10 * i + 10) for i in range(5)]
    for q in seqs:
        s.add(q)
    assert [s.replica_of(q.seq_id) for q in seqs] == [0, 1, 0, 1, 0]  # fewest running + waiting, then lowest index
    where = {q.seq_id: s.replica_of(q.seq_id) for q in seqs}
    preempted = 0
    while s.has_unfinished():
        plan = step(s)
        assert [p.seqs for p in plan.parts] and sum(len(p.seqs) for p in plan.parts) == len(plan.seqs)
        for i, part in enumerate(plan.parts):  # every sequence of a replica's part is that replica's
            assert all(where[item.seq_id] == i for item in part.seqs)
            assert all(b < 5 for item in part.seqs for b in item.block_table)  # block ids local to the replica
        preempted = s.num_preemptions
    assert all(q.is_finished and q.num_output_tokens == 4 for q in seqs)
    assert preempted > 0  # 5 blocks of 4 for two 10-token sequences: preemption within the replica
    assert s.block_manager.num_free_blocks == 10 and s.num_scheduled_tokens[0] > s.num_scheduled_tokens[1] > 0


def test_prefix_cache_hit_breaks_a_tie_and_samples_follow_their_leader():
    s = DPScheduler(2, num_blocks=32, block_size=4, enable_prefix_caching=True, **KW)
    a, b = req(9, 100), req(9, 200)
    s.add(a)
    s.add(b)
    while s.has_unfinished():
        step(s)
    c = req(9, 200)  # b's prompt: its first two blocks are cached on replica 1 only
    s.add(c)
    assert s.replica_of(c.seq_id) == 1
    d = req(5, 300)
    d.leader = c  # an n > 1 sample waits for its leader's blocks: it goes where the leader is
    s.add(d)
    assert s.replica_of(d.seq_id) == 1


def _seqs(plan_seqs):
    from moe_infer.engine.sequence import SchedulerOutput

    return SchedulerOutput(seqs=plan_seqs)


def test_dp_lay_out_pads_every_replica_to_the_same_sizes():
    s = DPScheduler(2, num_blocks=32, block_size=4, enable_prefix_caching=False, **KW)
    for q in (req(9, 10), req(3, 40), req(5, 60)):  # replica 0: 9 and 5 tokens; replica 1: 3
        s.add(q)
    plan = s.schedule()
    step_ = dp_lay_out(plan.parts, block_size=4)
    T, B, S, M = step_.sizes[:4]
    own = [flat_inputs(p, 4) for p in plan.parts]
    assert [sz[:2] for _, sz in own] == [(14, 2), (3, 1)]
    assert (T, B) == (14, 2)  # replica 1: one padding sequence of 11 rows
    for flat, (own_flat, own_sizes) in zip(step_.flats, own):
        assert flat.size == step_.flats[0].size
        seg, mine = host_segments(flat, step_.sizes), host_segments(own_flat, own_sizes)
        t, b, s_ = own_sizes[:3]
        np.testing.assert_array_equal(seg.ids_T[:t], mine.ids_T)  # the replica's own rows, unchanged
        np.testing.assert_array_equal(seg.slots_T[:t], mine.slots_T)
        assert (seg.slots_T[t:] == -1).all() and (seg.ids_T[t:] == 0).all()  # padding rows write no KV slot
        assert seg.query_start_B1[-1] == T and (np.diff(seg.query_start_B1)[b:] >= 1).all()
        np.testing.assert_array_equal(seg.sample_rows_S[:s_], mine.sample_rows_S)
        inputs = decode_inputs(__import__("torch").from_numpy(flat.copy()), step_.sizes, 4)  # a valid step layout
        assert inputs.meta.block_tables_BM.shape == (B, M)
    assert [len(r) for r in step_.sample_rows] == [2, 1] and S == 2


def test_pad_rows():
    from moe_infer.engine.dp_inputs import _pad_rows

    assert _pad_rows([3, 1], [3, 1], decode=True) == (3, 3, [[], [1, 1]])  # a decode step stays one
    assert _pad_rows([0, 2], [0, 2], decode=True) == (2, 2, [[1, 1], []])  # an idle replica: padding only
    # equal sequences, unequal rows: one padding sequence more on every replica to hold the rows
    assert _pad_rows([8, 5], [2, 2], decode=False) == (9, 3, [[1], [4]])
    assert _pad_rows([7, 7], [2, 2], decode=False) == (7, 2, [[], []])  # equal: nothing to pad
