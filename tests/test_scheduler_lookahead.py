"""The scheduler's lookahead for async scheduling (moe_infer/engine/scheduler.py, lookahead=True) without a
model: placeholders, sequences finished in flight, sequences finished by length, chunks, the full-cache
wait; and the sampler's count of the token in flight for penalties. The engine: tests/test_async_scheduling.py."""
from __future__ import annotations

import pytest
import torch

from moe_infer.engine.block_manager import BlockManager
from moe_infer.engine.sampler import SampleRequest, Sampler
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.engine.scheduler import Scheduler
from moe_infer.engine.sequence import PLACEHOLDER_TOKEN, SchedulerOutput, Sequence
from moe_infer.engine.step_inputs import plan_requests

pytestmark = pytest.mark.timeout(60)  # a scheduler that stops making progress must fail, not spin
EOS = 2


def lookahead(num_blocks=32, budget=64):
    return Scheduler(BlockManager(num_blocks, 4, True), 8, budget, 128, True, [EOS], lookahead=True)


def seq(n, first=10, **kw):
    return Sequence(f"r{first}", list(range(first, first + n)), SamplingParams(**kw))


def test_a_sequence_stopped_in_flight_keeps_its_blocks_and_loses_its_extra_token():
    s = lookahead()
    a = seq(5, max_tokens=10)
    s.add(a)
    p1 = s.schedule()  # the prefill samples a token the host does not know yet
    p2 = s.schedule()  # scheduled on top of it: its input is that token, taken on the device
    (item,) = p2.seqs
    assert item.input_in_flight and item.token_ids == [PLACEHOLDER_TOKEN] and item.start_pos == 5 and item.do_sample
    free = s.block_manager.num_free_blocks
    s.postprocess(p1, [EOS])  # step 1 stops it; step 2 is still writing its KV
    assert a.finish_reason == "stop" and a.output_token_ids == [EOS]
    assert s.block_manager.num_free_blocks == free and s.has_unfinished()
    s.postprocess(p2, [9])  # the extra token is discarded, the blocks come back
    assert a.output_token_ids == [EOS] and s.block_manager.num_free_blocks == 32 and not s.has_unfinished()


def test_a_sequence_finished_by_length_is_not_scheduled_again_and_chunks_go_on():
    s = lookahead(budget=6)
    short, long = seq(3, max_tokens=1), seq(9, first=40, max_tokens=3)
    s.add(short)
    s.add(long)
    p1 = s.schedule()
    assert [(i.seq_id, len(i.token_ids), i.do_sample) for i in p1.seqs] == [(short.seq_id, 3, True), (long.seq_id, 3, False)]
    p2 = s.schedule()  # short reaches max_tokens with step 1's token; long's next chunk is known
    assert [(i.seq_id, i.token_ids, i.start_pos) for i in p2.seqs] == [(long.seq_id, [43, 44, 45, 46, 47, 48], 3)]
    s.postprocess(p1, [7, None])
    assert short.finish_reason == "length" and short.block_table == []  # not in flight: freed at once
    s.postprocess(p2, [8])
    assert long.num_computed_tokens == 9 and long.num_pending_tokens == long.num_placeholders == 0
    assert long.output_token_ids == [8]
    edge = Scheduler(BlockManager(32, 4, True), 8, 64, 8, True, [EOS], lookahead=True)  # max_model_len 8
    last = seq(7, max_tokens=None)
    edge.add(last)
    p1 = edge.schedule()
    assert edge.schedule().is_empty  # position 7 would be past max_model_len
    edge.postprocess(p1, [7])
    assert last.finish_reason == "length" and not edge.has_unfinished()


def test_penalties_count_the_token_in_flight_on_the_device():
    s = lookahead()
    a = seq(5, max_tokens=10, repetition_penalty=1.2)
    s.add(a)
    s.schedule()
    (item,) = s.schedule().seqs  # the history the host knows lacks step 1's token: this step's input
    assert item.input_in_flight and item.history == list(range(10, 15))
    (req,) = plan_requests(SchedulerOutput([item]))
    assert req.last_on_device and req.num_output_tokens == 1
    V = 32
    logits_BV = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    ps = [SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=1.0),
          SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.5), SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    history = [[3, 4, 20, 21], [5, 22, 22], [6, 23], [7, 20, 23, 23]]  # prompts of 2, 1, 1, 2 tokens
    for i, h in enumerate(history):
        logits_BV[i, h[-1]] += 8.0  # each row's last token is its favourite, unless the penalties count it
    full = [SampleRequest(i, p, n, len(h) - n, h) for i, (p, n, h) in enumerate(zip(ps, (2, 1, 1, 2), history))]
    lacking = [SampleRequest(i, p, n, len(h) - n, h[:-1], True) for i, (p, n, h) in enumerate(zip(ps, (2, 1, 1, 2), history))]
    want = Sampler(V, [EOS], "cpu").sample(logits_BV, full).result().token_ids
    got = Sampler(V, [EOS], "cpu").sample(logits_BV, lacking, torch.tensor([h[-1] for h in history])).result()
    assert got.token_ids == want
    assert Sampler(V, [EOS], "cpu")(logits_BV[:1], [SampleRequest(0, ps[0], 2, 1, history[0][:-1])]).token_ids != want[:1]


def test_a_full_cache_waits_for_the_batch_in_flight():
    s = lookahead(num_blocks=4)
    b, c = seq(7, max_tokens=10), seq(8, first=40, max_tokens=10)
    s.add(b)
    s.add(c)
    p1 = s.schedule()  # b: 2 blocks, room for its next token; c: 2 blocks, its next token needs a third
    assert [len(i.token_ids) for i in p1.seqs] == [7, 8]
    assert s.schedule().is_empty  # the whole step waits (b is not scheduled on its own)
    s.postprocess(p1, [7, 8])
    p2 = s.schedule()  # nothing in flight: c is preempted as without lookahead
    assert [i.seq_id for i in p2.seqs] == [b.seq_id] and s.num_preemptions == 1 and c.output_token_ids == [8]


def seats(max_num_seqs, num_blocks=32):
    return Scheduler(BlockManager(num_blocks, 4, True), max_num_seqs, 64, 128, True, [EOS], lookahead=True)


def planned(plan):
    return [(i.seq_id, len(i.token_ids)) for i in plan.seqs]


def test_sequences_ending_by_length_in_flight_leave_their_seats_to_waiting_ones():
    """A sequence whose batch in flight ends it by length holds its blocks, not its seat under max_num_seqs; one
    that may still stop on a token (EOS) keeps its seat."""
    s = seats(2)
    a, b, c, d = (seq(5, first=10 * i, max_tokens=1, ignore_eos=True) for i in range(1, 5))
    e = seq(5, first=50, max_tokens=3)
    for x in (e, a, b, c, d):
        s.add(x)
    p1 = s.schedule()
    assert planned(p1) == [(e.seq_id, 5), (a.seq_id, 5)]
    p2 = s.schedule()  # a ends with step 1's token: b takes its seat, in free blocks; e goes on
    assert planned(p2) == [(e.seq_id, 1), (b.seq_id, 5)] and len(s.running) == 3
    assert not set(a.block_table) & set(b.block_table) and len(a.block_table) == 2
    s.postprocess(p1, [7, 8])
    assert a.finish_reason == "length" and a.block_table == [] and s.running == [e, b]
    p3 = s.schedule()  # b ends with step 2's token: c comes in
    assert planned(p3) == [(e.seq_id, 1), (c.seq_id, 5)]
    s.postprocess(p2, [7, 9])
    p4 = s.schedule()  # e ends with step 3's token (its third), c with its first: d takes one of their seats
    assert planned(p4) == [(d.seq_id, 5)]
    s.postprocess(p3, [7, 9])
    s.postprocess(p4, [9])
    assert [x.output_token_ids for x in (e, a, b, c, d)] == [[7, 7, 7], [8], [9], [9], [9]]
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 32
    eos = seats(1)
    f, g = seq(5, first=10, max_tokens=4), seq(5, first=20, max_tokens=1)
    eos.add(f)
    eos.add(g)
    eos.schedule()
    assert eos.schedule().seqs[0].seq_id == f.seq_id and g in eos.waiting  # f may stop on EOS: it keeps the seat


def test_seats_left_in_flight_take_only_free_blocks_and_never_preempt():
    s = seats(2, num_blocks=6)  # a and b take 2 blocks each; 2 are free
    a, b = seq(5, first=10, max_tokens=1), seq(5, first=20, max_tokens=4)
    c, d = seq(9, first=30, max_tokens=1), seq(7, first=50, max_tokens=1)
    for x in (a, b, c):
        s.add(x)
    p1 = s.schedule()
    p2 = s.schedule()  # a's seat is free, but c needs 3 blocks: it waits (a's blocks are written by step 1)
    assert planned(p2) == [(b.seq_id, 1)] and s.waiting[0] is c and s.num_preemptions == 0
    s.postprocess(p1, [7, 8])
    p3 = s.schedule()
    assert planned(p3) == [(b.seq_id, 1), (c.seq_id, 9)] and s.block_manager.num_free_blocks == 1
    s.add(d)
    s.postprocess(p2, [8])
    p4 = s.schedule()  # c's seat is free, d needs 2 blocks and 1 is free: b goes on alone, nobody preempted
    assert planned(p4) == [(b.seq_id, 1)] and s.num_preemptions == 0
    s.postprocess(p3, [8, 7])
    p5 = s.schedule()  # b ends with step 4's token; c is done: d comes in
    assert planned(p5) == [(d.seq_id, 7)]
    s.postprocess(p4, [8])
    s.postprocess(p5, [9])
    assert [x.output_token_ids for x in (a, b, c, d)] == [[7], [8, 8, 8, 8], [7], [9]]
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 6
