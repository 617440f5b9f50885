"""Scheduler policy without a model: budgets, chunked prefill, preemption order, rejection, plan shape."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from moe_infer.engine.block_manager import BlockManager
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.engine.scheduler import Scheduler
from moe_infer.engine.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.timeout(60)  # a scheduler that stops making progress must fail, not spin

EOS = 2


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=64, max_model_len=128, chunked=True,
         prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_num_seqs, max_tokens_per_step, max_model_len, chunked, [EOS])


def req(n, max_tokens=4, first=10, **kw):
    return Sequence(f"r{first}", list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, **kw))


def run_step(s, token=7):
    plan = s.schedule()
    s.postprocess(plan, [token if item.do_sample else None for item in plan.seqs])
    return plan


def test_budget_and_max_num_seqs():
    s = make(max_num_seqs=2, max_tokens_per_step=64)
    seqs = [req(5, first=10 * i) for i in range(1, 4)]
    for q in seqs:
        s.add(q)
    plan = run_step(s)
    assert [p.seq_id for p in plan.seqs] == [seqs[0].seq_id, seqs[1].seq_id]  # max_num_seqs = 2
    assert all(p.do_sample and len(p.token_ids) == 5 for p in plan.seqs)
    plan = run_step(s)  # two decodes of 1 token; the third request still waits
    assert [len(p.token_ids) for p in plan.seqs] == [1, 1] and len(s.waiting) == 1


def test_chunked_prefill_mixed_with_decodes():
    s = make(max_tokens_per_step=8)
    a, b = req(3, max_tokens=8, first=10), req(20, first=40)
    s.add(a)
    run_step(s)  # a prefilled
    s.add(b)
    plan = run_step(s)
    assert [(p.seq_id, len(p.token_ids), p.do_sample) for p in plan.seqs] == [(a.seq_id, 1, True), (b.seq_id, 7, False)]
    assert plan.num_tokens == 8
    plan = run_step(s)
    assert [(len(p.token_ids), p.start_pos) for p in plan.seqs] == [(1, 4), (7, 7)]
    plan = run_step(s)  # b's last 6 tokens end its prompt: it samples
    assert [(len(p.token_ids), p.do_sample) for p in plan.seqs] == [(1, True), (6, True)]
    assert b.num_output_tokens == 1 and s.num_chunked_prefills == 2


def test_no_chunking_waits_for_budget():
    s = make(max_tokens_per_step=8, chunked=False)
    a, b = req(6, first=10), req(6, first=40)
    s.add(a), s.add(b)
    plan = run_step(s)
    assert [p.seq_id for p in plan.seqs] == [a.seq_id]  # b does not fit whole in the 2 tokens left


def test_preempts_newest_and_oldest_keep_priority():
    s = make(num_blocks=6, block_size=4, max_tokens_per_step=64)
    old, mid, new = req(7, max_tokens=12, first=10), req(7, max_tokens=12, first=30), req(7, max_tokens=12, first=50)
    for q in (old, mid, new):
        s.add(q)
    run_step(s)  # 3 x 2 blocks = all 6
    run_step(s)  # 8 tokens each still fit in 2 blocks
    plan = run_step(s)  # old needs a 3rd block: the newest is preempted
    assert new.status == SequenceStatus.WAITING and new.num_computed_tokens == 0 and not new.block_table
    assert s.waiting[0] is new and s.num_preemptions == 1 and new.metrics.num_preemptions == 1
    assert [p.seq_id for p in plan.seqs] == [old.seq_id, mid.seq_id]
    assert new.num_output_tokens == 2  # its generated tokens are kept and recomputed later
    while s.has_unfinished():
        run_step(s)
    assert all(q.finish_reason == "length" and q.num_output_tokens == 12 for q in (old, mid, new))
    assert s.block_manager.num_free_blocks == 6


def test_prompt_chunks_read_the_prompt_array():
    """A sequence given its prompt as an int64 array (as add_request does) is planned with views of that array for
    its prompt chunks; a recompute after preemption that reaches its generated tokens takes the token list."""
    s = make(num_blocks=6, block_size=4, max_tokens_per_step=64)
    seqs = [Sequence(f"r{f}", list(range(f, f + 7)), SamplingParams(max_tokens=12),
                     prompt_array=np.arange(f, f + 7, dtype=np.int64)) for f in (10, 30, 50)]
    for q in seqs:
        s.add(q)
    plan = run_step(s)
    for item, q in zip(plan.seqs, seqs):
        assert isinstance(item.token_ids, np.ndarray) and np.shares_memory(item.token_ids, q.prompt_array)
        assert item.token_ids.tolist() == q.prompt_token_ids
    assert all(isinstance(item.token_ids, list) for item in run_step(s).seqs)  # decodes
    run_step(s)  # the newest is preempted, with 2 generated tokens
    new = seqs[2]
    assert new.status == SequenceStatus.WAITING and new.num_output_tokens == 2
    plan = run_step(s)
    while not any(item.seq_id == new.seq_id for item in plan.seqs):
        plan = run_step(s)
    item = next(item for item in plan.seqs if item.seq_id == new.seq_id)
    assert isinstance(item.token_ids, list) and item.token_ids == new.token_ids[:9] and item.start_pos == 0


def test_rejects_what_can_never_run_and_keeps_others():
    s = make(num_blocks=4, block_size=4, max_model_len=32)
    too_long, too_big, ok = req(40, first=0), req(20, first=100), req(5, first=60)
    for q in (too_long, too_big, ok):
        s.add(q)
    assert too_long.finish_reason == "error" and "max_model_len" in too_long.error
    assert too_big.finish_reason == "error" and "can never fit in the KV cache" in too_big.error
    empty = Sequence("e", [], SamplingParams())
    s.add(empty)
    assert empty.finish_reason == "error" and "empty" in empty.error
    while s.has_unfinished():
        run_step(s)
    assert ok.finish_reason == "length"


def test_stop_token_eos_min_tokens_and_max_model_len():
    s = make(max_model_len=10)
    eos, stop_id, ign, capped = (req(3, max_tokens=5, first=10), req(3, max_tokens=5, first=20, stop_token_ids=[7]),
                                 req(3, max_tokens=3, first=30, ignore_eos=True), req(8, max_tokens=50, first=40, ignore_eos=True))
    for q in (eos, stop_id, ign, capped):
        s.add(q)
    plan = s.schedule()
    s.postprocess(plan, [EOS, 7, EOS, 3])
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    assert stop_id.finish_reason == "stop" and stop_id.stop_reason == 7
    assert ign.finish_reason is None
    run_step(s, token=EOS)
    assert capped.finish_reason == "length" and len(capped) == 10
    run_step(s, token=EOS)
    assert ign.finish_reason == "length" and ign.output_token_ids == [EOS] * 3
    m = req(3, max_tokens=5, first=50, min_tokens=2)
    s.add(m)
    run_step(s, token=EOS)
    assert m.finish_reason is None  # min_tokens: an EOS before 2 outputs does not stop
    run_step(s, token=EOS)
    assert m.finish_reason == "stop"


def test_abort_frees_blocks_and_plan_is_picklable():
    s = make()
    a, b = req(9, max_tokens=5, first=10), req(5, first=30, repetition_penalty=1.2)
    s.add(a), s.add(b)
    plan = s.schedule()
    clone = pickle.loads(pickle.dumps(plan))
    assert clone == plan and clone.seqs[1].history == b.token_ids
    s.postprocess(plan, [1, 1])
    s.abort(a)
    assert a.finish_reason == "abort" and a not in s.running
    assert s.schedule().finished_seq_ids == [a.seq_id]
    s.abort(b)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
