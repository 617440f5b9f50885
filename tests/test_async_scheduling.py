"""Async scheduling (moe_infer/engine/async_scheduling.py): the engine with async scheduling on against the
synchronous engine (the reference: it is what the transformers parity tests check) over a mixed workload,
penalties, failing steps, the server's AsyncEngine, the fallbacks, and the GPU decode graphs. The scheduler's
lookahead alone: tests/test_scheduler_lookahead.py."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine_fixtures import checkpoint
from moe_infer import LLM, SamplingParams
from moe_infer.config import EngineConfig, OffloadConfig, RoutingConfig, SchedulerConfig, SpeculativeConfig
from moe_infer.engine.async_engine import AsyncEngine
from moe_infer.engine.async_scheduling import AsyncStepExecutor, async_scheduling_blocker
from moe_infer.parallel.pipeline import LocalExecutor
from moe_infer.parallel.dims import ParallelDims

pytestmark = pytest.mark.timeout(120)  # an engine loop that stops making progress must fail, not spin


# ---------------------------------------------------------------------------------------------- the engine
def make_llm(async_scheduling, **kw):
    args = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=28, max_num_seqs=8,
                max_num_batched_tokens=16, async_scheduling=async_scheduling)
    return LLM(model=checkpoint("olmoe", tokenizer=True, vocab_size=100), **{**args, **kw})


@pytest.fixture(scope="module")
def llms():
    return {mode: make_llm(mode) for mode in (True, False)}


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def workload(ref):
    """(request id, prompt, params): lengths, a stop string, stop tokens with min_tokens, n=2 over a cached
    prefix, seeds, logprobs, penalties, a prompt chunked over steps; the stops are taken from ref's greedy text."""
    text = ref.generate("class A:", greedy(16), use_tqdm=False)[0].outputs[0]
    tokens = ref.generate("x = [1, 2", greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    return [
        ("greedy", "def f(x):", greedy(14)),
        ("seeded", "import os", SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=11, max_tokens=12,
                                               ignore_eos=True, logprobs=2)),
        ("stop_str", "class A:", greedy(16, stop=[text.text[5:7]])),
        ("stop_tok", "x = [1, 2", greedy(16, min_tokens=4, stop_token_ids=tokens[2:9])),
        ("n2", "def f(x): return", SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=10, ignore_eos=True)),
        ("penalty", "for i in range(10):", greedy(10, repetition_penalty=1.8, frequency_penalty=1.5,
                                                  presence_penalty=0.5)),  # greedy: every penalty shows
        ("penalty_seeded", "for i in range(10):", SamplingParams(temperature=0.7, seed=9, repetition_penalty=1.3,
                                                                 max_tokens=10, ignore_eos=True)),
        ("long", "while True: pass  # a prompt longer than one step's budget", greedy(8, logprobs=0)),
        ("abort", "import sys", greedy(30)),
    ]


def run_workload(llm, requests):
    """Drives the engine by hand: "abort" is aborted once it shows 3 tokens, "late" is added once "greedy"
    shows 5; returns the final outputs by request id."""
    eng, finals = llm.engine, {}
    for rid, prompt, params in requests:
        eng.add_request(prompt, params, rid)
    while eng.has_unfinished_requests():
        for out in eng.step():
            num = len(out.outputs[0].token_ids)
            if out.request_id == "abort" and not out.finished and num >= 3:
                eng.abort_request("abort")
            if out.request_id == "greedy" and num >= 5 and "late" not in eng.requests and "late" not in finals:
                eng.add_request("def f(x):", SamplingParams(temperature=1.0, seed=3, max_tokens=6), "late")
            if out.finished:
                finals[out.request_id] = out
    return finals


def summary(out):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted(lp) for lp in c.logprobs]) for c in out.outputs]


def assert_no_leak(llm):
    bm, sched = llm.engine.block_manager, llm.engine.scheduler
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not sched.running and not sched.waiting and not sched._held and not llm.engine.requests


def count_calls(monkeypatch, obj, name, count):
    """obj.name(*args) counted: count(args, result) is added to obj's counter `name`."""
    real, counts = getattr(obj, name), {}

    def wrapper(*args):
        before = count(args, None)
        out = real(*args)
        counts[name] = counts.get(name, 0) + (before if before is not None else count(args, out))
        return out

    monkeypatch.setattr(obj, name, wrapper)
    return counts


def test_async_equals_sync_on_a_mixed_workload(llms, monkeypatch):
    on, off = llms[True], llms[False]
    assert isinstance(on.engine.executor, AsyncStepExecutor) and on.engine.scheduler.lookahead
    assert type(off.engine.executor) is LocalExecutor and not off.engine.scheduler.lookahead
    requests = workload(off)
    sched = on.engine.scheduler
    placeholders = count_calls(monkeypatch, on.engine.runner, "prepare",
                               lambda a, out: sum(s.input_in_flight for s in a[0].seqs))
    waits = count_calls(monkeypatch, sched, "_must_wait", lambda a, out: None if out is None else int(out))
    discarded = count_calls(monkeypatch, sched, "_release", lambda a, out: int(a[0] in sched._held))
    preempted = [llm.engine.scheduler.num_preemptions for llm in (on, off)]
    hits = on.engine.block_manager.num_prefix_hits
    ref, got = run_workload(off, requests), run_workload(on, requests)
    assert sorted(got) == sorted(ref) == sorted([r[0] for r in requests] + ["late"])
    for rid in ref:
        assert summary(got[rid]) == summary(ref[rid]), rid
        for a, b in zip(got[rid].outputs, ref[rid].outputs):
            if a.logprobs is not None:
                assert [v.logprob for lp in a.logprobs for v in lp.values()] == pytest.approx(
                    [v.logprob for lp in b.logprobs for v in lp.values()], abs=1e-5)
    reasons = {rid: [c.finish_reason for c in out.outputs] for rid, out in ref.items()}
    assert reasons["stop_str"] == ["stop"] and reasons["stop_tok"] == ["stop"] and reasons["abort"] == ["abort"]
    assert len(ref["abort"].outputs[0].token_ids) == 3 and len(ref["stop_tok"].outputs[0].token_ids) >= 4
    assert all(llm.engine.scheduler.num_preemptions > p for llm, p in zip((on, off), preempted))  # a tiny cache
    assert on.engine.block_manager.num_prefix_hits > hits
    # the lookahead ran: placeholder inputs, steps that waited (penalties, a full cache), extra tokens discarded
    assert placeholders["prepare"] >= 10 and waits["_must_wait"] > 0 and discarded["_release"] > 0
    assert_no_leak(on)
    assert_no_leak(off)


def test_penalties_over_the_token_in_flight_equal_sync(llms):
    """Every decode step of these is scheduled ahead (the cache has room): the penalties count the token in
    flight on the device. Strong penalties, both signs, so that missing the last token changes the output."""
    prompts = ["import re", "def g(y):", "x = 3"]
    for kw in (dict(repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0),
               dict(presence_penalty=-2.0, frequency_penalty=-2.0)):
        ref, got = (llms[mode].generate(prompts, greedy(8, **kw), use_tqdm=False) for mode in (False, True))
        assert [summary(o) for o in got] == [summary(o) for o in ref]


def saturate(llm, max_tokens):
    """3 * max_num_seqs requests at once, all ending by length together (greedy and seeded): the final outputs
    and the number of engine steps."""
    eng, finals, steps = llm.engine, {}, 0
    for i in range(24):
        sp = greedy(max_tokens) if i % 2 else SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                                             ignore_eos=True)
        eng.add_request(f"{i:02d}: x", sp, str(i))
    while eng.has_unfinished_requests():
        finals.update((o.request_id, summary(o)) for o in eng.step() if o.finished)
        steps += 1
    return finals, steps


def test_sequences_ending_by_length_leave_their_seats_in_the_step_scheduled_ahead(monkeypatch):
    """Under saturation with short outputs, the step scheduled while a batch's last step is in flight admits the
    next batch (before, it waited for their seats under max_num_seqs: one step in two or five ran nothing)."""
    on, off = (make_llm(a, max_num_batched_tokens=64, num_kv_blocks=64) for a in (True, False))
    plans = {}
    for llm in (on, off):  # the plan of every step
        real, log = llm.engine.scheduler.schedule, plans.setdefault(llm, [])
        monkeypatch.setattr(llm.engine.scheduler, "schedule", lambda real=real, log=log: log.append(real()) or log[-1])
    for max_tokens in (1, 4):
        ref, steps_off = saturate(off, max_tokens)
        got, steps_on = saturate(on, max_tokens)
        assert got == ref and len(ref) == 24
        sizes = [[len(p.seqs) for p in plans[llm] if not p.is_empty] for llm in (on, off)]
        assert sizes[0] == sizes[1] == [8] * 3 * max_tokens  # every step that ran, ran full
        assert (steps_off, steps_on) == (3 * max_tokens, 3 * max_tokens + 1)  # + collecting the last step
        plans[on].clear(), plans[off].clear()
    assert_no_leak(on)
    assert_no_leak(off)


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_failing_step_fails_only_its_requests(llms, monkeypatch, where):
    off = llms[False]
    params = [greedy(8), greedy(6)]
    ref = off.generate(["def f(x):", "import os"], params, use_tqdm=False)
    llm = make_llm(True, max_num_seqs=1)  # one sequence a step: the other request is in other steps
    runner, calls = llm.engine.runner, {"n": 0}
    real = getattr(runner, where)

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:  # a step of the first request, another one in flight
            raise RuntimeError("simulated device fault")
        return real(*args)

    monkeypatch.setattr(runner, where, flaky)
    eng, finals = llm.engine, {}
    for rid, prompt, sp in zip("ab", ["def f(x):", "import os"], params):
        eng.add_request(prompt, sp, rid)
    for _ in range(100):  # bounded: a sequence held for ever would keep the engine stepping
        finals.update((o.request_id, o) for o in eng.step() if o.finished)
        if not eng.has_unfinished_requests():
            break
    outs = [finals["a"], finals["b"]]
    first = outs[0].outputs[0]
    assert first.finish_reason == "error" and "simulated device fault" in first.error
    assert first.token_ids == ref[0].outputs[0].token_ids[:len(first.token_ids)]
    assert summary(outs[1]) == summary(ref[1])
    assert_no_leak(llm)


def test_the_async_engine_streams_equal_the_sync_engine_and_aborts_free_blocks(llms):
    on, off = llms[True], llms[False]
    prompts = ["def f(x):", "import os", "class A:"]
    params = [greedy(10), SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=8, ignore_eos=True), greedy(9)]
    ref = off.generate(prompts, params, use_tqdm=False)

    async def final(engine, prompt, sp):
        out = None
        async for out in engine.generate(prompt, sp):
            pass
        return out

    async def main():
        engine = AsyncEngine(on.engine)
        await engine.start()
        dropped = engine.generate("import sys", greedy(200))
        await dropped.__anext__()
        outs = await asyncio.gather(*(final(engine, p, sp) for p, sp in zip(prompts, params)))
        await dropped.aclose()  # the client went away mid-way
        for _ in range(200):
            if not on.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        await engine.shutdown()
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 100))
    assert [summary(o) for o in outs] == [summary(o) for o in ref]
    assert_no_leak(on)


def test_fallbacks_are_chosen_per_engine():
    class Mesh:
        def __init__(self, pp):
            self.is_distributed, self.dims = True, ParallelDims(2, pp=pp, tp=3 - pp)

    class One:
        is_distributed = False

    assert async_scheduling_blocker(EngineConfig(), One()) is None
    assert async_scheduling_blocker(EngineConfig(), Mesh(pp=1)) is None  # tp = 2: the driver schedules ahead
    assert "pipeline stages" in async_scheduling_blocker(EngineConfig(), Mesh(pp=2))
    assert "async_scheduling=false" in async_scheduling_blocker(
        EngineConfig(scheduler=SchedulerConfig(async_scheduling=False)), One())
    assert "offload.store=cpu" in async_scheduling_blocker(EngineConfig(offload=OffloadConfig(store="cpu")), One())
    assert "routing.trace" in async_scheduling_blocker(EngineConfig(routing=RoutingConfig(trace=True)), One())
    for method in ("ngram", "draft"):  # verify steps drain the step in flight; plain steps schedule ahead
        spec = SpeculativeConfig(method=method, draft_model="/d" if method == "draft" else None)
        assert async_scheduling_blocker(EngineConfig(speculative=spec), One()) is None
    assert "speculative.method=mtp" in async_scheduling_blocker(
        EngineConfig(speculative=SpeculativeConfig(method="mtp")), One())
    traced = make_llm(True, routing_trace=True)
    assert type(traced.engine.executor) is LocalExecutor and not traced.engine.scheduler.lookahead


@pytest.mark.gpu
@pytest.mark.timeout(600)  # the first GPU test of a process JIT-compiles the Triton kernels
def test_async_equals_sync_with_decode_graphs_and_launches_without_a_host_sync(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw = dict(dtype="float32", device="cuda", block_size=16, num_kv_blocks=64, max_num_seqs=8)
    on, off = (LLM(model=checkpoint("qwen3_moe"), async_scheduling=a, **kw) for a in (True, False))
    assert on.engine.runner.graphs is not None
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 9, 30)]
    params = [greedy(24), SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True, logprobs=1),
              greedy(12, stop_token_ids=[5, 6, 7]), SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=16)]
    ref = off.generate(prompts, params, use_tqdm=False)
    on.generate(prompts, params, use_tqdm=False)  # warm-up: every graph bucket captured
    runner, decode_launches = on.engine.runner, {"n": 0}
    real = runner.launch

    def no_sync_launch(plan, prev=None):
        if not all(len(s.token_ids) == 1 for s in plan.seqs) or plan.is_empty:
            return real(plan, prev)
        decode_launches["n"] += 1
        torch.cuda.set_sync_debug_mode("error")  # any host sync inside the launch raises
        try:
            return real(plan, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(runner, "launch", no_sync_launch)
    runs = runner.graphs.runs
    got = on.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].error for o in got] == [None] * 4  # a sync in a launch would fail its step
    assert [[c[:4] for c in summary(o)] for o in got] == [[c[:4] for c in summary(o)] for o in ref]
    assert runner.graphs.runs - runs >= decode_launches["n"] > 10
    assert_no_leak(on)
