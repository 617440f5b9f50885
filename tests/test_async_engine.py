"""AsyncEngine without HTTP: concurrent streams equal the sync LLM's outputs, early close aborts, failures stay
with their requests, the loop survives an error outside a step, shutdown drains or aborts, overload."""
from __future__ import annotations

import asyncio

import pytest

from moe_infer import LLM, SamplingParams
from moe_infer.engine.async_engine import AsyncEngine, EngineClosed, EngineOverloaded, RequestFailed

pytestmark = pytest.mark.timeout(180)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=4)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def started(llm, **kw) -> AsyncEngine:
    engine = AsyncEngine(llm.engine, **kw)
    await engine.start()
    return engine


async def final(engine, prompt, params, rid=None):
    out = None
    async for out in engine.generate(prompt, params, rid):
        pass
    return out


def free_blocks(llm):
    return llm.engine.get_stats().num_free_kv_blocks


def test_concurrent_streams_equal_sync_generate(llm):
    prompts = ["def f(x):", "import os", "class A:", {"prompt_token_ids": [5, 6, 7, 8]}, "x = [1, 2"]
    params = [PARAMS, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, n=2)] * 2 + [PARAMS]
    ref = llm.generate(prompts, params, use_tqdm=False)

    async def main():
        engine = await started(llm)
        outs = await asyncio.gather(*(final(engine, p, sp) for p, sp in zip(prompts, params)))
        await engine.shutdown()
        return outs

    outs = run(main())
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]


def test_closing_a_stream_aborts_and_frees_its_blocks(llm):
    async def main():
        engine = await started(llm)
        gen = engine.generate("def f(x):", SamplingParams(max_tokens=500, ignore_eos=True))
        outs = [await gen.__anext__() for _ in range(3)]
        assert len(outs[-1].outputs[0].token_ids) >= 1 and free_blocks(llm) < 64
        await gen.aclose()  # the client went away
        for _ in range(200):
            if free_blocks(llm) == 64 and not llm.engine.requests:
                break
            await asyncio.sleep(0.01)
        assert free_blocks(llm) == 64 and not llm.engine.requests and engine.num_requests == 0
        await engine.shutdown()

    run(main())


def test_a_bad_request_fails_alone_and_a_loop_error_fails_only_whats_in_flight(llm, monkeypatch):
    async def main():
        engine = await started(llm)
        bad = final(engine, {"prompt_token_ids": [1, 10**6]}, PARAMS)
        good = final(engine, "def f(x):", PARAMS)
        bad_out, good_out = await asyncio.gather(bad, good)
        assert bad_out.outputs[0].finish_reason == "error" and "outside the vocabulary" in bad_out.outputs[0].error
        assert good_out.outputs[0].finish_reason == "length"
        real_step = llm.engine.step
        calls = {"n": 0}

        def broken_step(final_only=False):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("scheduler bug")
            return real_step(final_only)

        monkeypatch.setattr(llm.engine, "step", broken_step)
        with pytest.raises(RequestFailed, match="scheduler bug"):
            await final(engine, "def g(y):", PARAMS)
        monkeypatch.setattr(llm.engine, "step", real_step)
        after = await final(engine, "def f(x):", PARAMS)  # the loop lives on
        assert after.outputs[0].token_ids == good_out.outputs[0].token_ids and engine.num_loop_errors == 1
        await engine.shutdown()
        assert free_blocks(llm) == 64 and not llm.engine.requests

    run(main())


def test_shutdown_drains_or_aborts(llm):
    async def main():
        engine = await started(llm)
        long = asyncio.ensure_future(final(engine, "def f(x):", SamplingParams(max_tokens=300, ignore_eos=True)))
        short = asyncio.ensure_future(final(engine, "import os", SamplingParams(max_tokens=4, ignore_eos=True)))
        await asyncio.sleep(0.3)
        await engine.shutdown(drain_timeout_s=1.0)  # long is cut, short had time
        assert (await short).outputs[0].finish_reason == "length"
        cut = await long
        assert cut.outputs[0].finish_reason == "abort" and 0 < len(cut.outputs[0].token_ids) < 300
        with pytest.raises(EngineClosed):
            engine.open("x", PARAMS)
        assert free_blocks(llm) == 64

    run(main())


def test_overload_is_refused_at_once(llm):
    async def main():
        engine = await started(llm, max_requests=2)
        streams = [engine.open("def f(x):", PARAMS) for _ in range(2)]
        with pytest.raises(EngineOverloaded, match="limit is 2"):
            engine.open("def f(x):", PARAMS)
        for s in streams:
            async for out in s:
                pass
            assert out.finished
        engine.open("def f(x):", PARAMS).close()  # room again
        await engine.shutdown()

    run(main())
