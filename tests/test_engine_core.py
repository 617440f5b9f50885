"""ProcessEngine, the engine in a process of its own (the server's default), without HTTP: streams equal the
offline LLM's outputs; a bad request fails alone; closing a stream frees its blocks in the core; overload;
shutdown drains or aborts and the core exits 0; a core that dies fails every stream at once (nothing
hangs); a core that cannot start says why; a core whose server process dies exits by itself."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moe_infer import LLM, SamplingParams
from moe_infer.assets import default_model_path
from moe_infer.engine.core_client import EngineStartError, ProcessEngine
from moe_infer.engine.llm import build_config
from moe_infer.engine.request_streams import EngineClosed, EngineOverloaded

pytestmark = pytest.mark.timeout(180)
ENGINE = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def process_engine(**kw) -> ProcessEngine:
    return ProcessEngine(build_config(model=default_model_path(), **ENGINE), default_model_path(), **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 150))


async def final(engine, prompt, params, rid=None):
    out = None
    async for out in engine.generate(prompt, params, rid):
        pass
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) counts as gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_streams_equal_offline_generate_and_the_core_ends_clean():
    prompts = ["def f(x):", {"prompt_token_ids": [5, 6, 7, 8]}, "class A:", "import os", "x = [1, 2"]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=30, stop=["\n\n", "self"]),
              SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8, ignore_eos=True)]
    ref = LLM(**ENGINE).generate(prompts, params, use_tqdm=False)
    engine = process_engine(max_requests=8)

    async def main():
        await engine.start()
        outs = await asyncio.gather(*(final(engine, p, sp) for p, sp in zip(prompts, params)))
        bad, malformed, good = await asyncio.gather(final(engine, {"prompt_token_ids": [1, 10**6]}, GREEDY),
                                                    final(engine, 42, GREEDY), final(engine, "def f(x):", GREEDY))
        gen = engine.generate("def g(y):", SamplingParams(max_tokens=400, ignore_eos=True))
        for _ in range(3):
            await gen.__anext__()
        busy = await engine.utility("state")
        await gen.aclose()  # the client went away: the core aborts it and frees its blocks
        for _ in range(300):
            if (idle := await engine.utility("state")).is_idle:
                break
            await asyncio.sleep(0.01)
        await engine.shutdown()
        return outs, (bad, malformed, good), busy, idle

    outs, (bad, malformed, good), busy, idle = run(main())
    for got, want in zip(outs[:4], ref[:4]):  # greedy: equal to the token, text and logprob
        assert got.prompt_token_ids == want.prompt_token_ids and got.prompt == want.prompt
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in got.outputs] == \
               [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in want.outputs]
    assert [len(lp) for lp in outs[3].outputs[0].logprobs] == [len(lp) for lp in ref[3].outputs[0].logprobs]
    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for a, b in zip(outs[3].outputs[0].logprobs,
                                                                      ref[3].outputs[0].logprobs) for t in a)
    assert [len(c.token_ids) for c in outs[4].outputs] == [8, 8] and outs[4].finished
    assert bad.outputs[0].finish_reason == "error" and "outside the vocabulary" in bad.outputs[0].error
    assert malformed.outputs[0].finish_reason == "error" and "a prompt is a string" in malformed.outputs[0].error
    assert good.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert busy.num_free_kv_blocks < busy.num_kv_blocks and idle.is_idle and engine.num_requests == 0
    engine.close()
    assert engine._core.proc.exitcode == 0


def test_overload_and_shutdown_drain_or_abort():
    engine = process_engine(max_requests=2)

    async def main():
        await engine.start()
        long = asyncio.ensure_future(final(engine, "def f(x):", SamplingParams(max_tokens=400, ignore_eos=True)))
        short = asyncio.ensure_future(final(engine, "import os", SamplingParams(max_tokens=4, ignore_eos=True)))
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloaded, match="limit is 2"):
            engine.open("def f(x):", GREEDY)
        await asyncio.sleep(0.5)
        await engine.shutdown(drain_timeout_s=1.0)  # long is cut, short had time
        assert (await short).outputs[0].finish_reason == "length"
        cut = await long
        assert cut.outputs[0].finish_reason == "abort" and 0 < len(cut.outputs[0].token_ids) < 400
        with pytest.raises(EngineClosed):
            engine.open("x", GREEDY)

    run(main())
    engine.close()
    assert engine._core.proc.exitcode == 0


def test_a_core_that_dies_fails_every_stream_at_once():
    engine = process_engine()

    async def main():
        await engine.start()
        streams = [engine.open("def f(x):", SamplingParams(max_tokens=400, ignore_eos=True)) for _ in range(3)]
        await streams[0].__anext__()
        os.kill(engine.core_pid, signal.SIGKILL)  # as the kernel's out-of-memory killer would
        for s in streams:
            with pytest.raises(EngineClosed, match="exited"):
                async for _ in s:
                    pass
        assert not engine.is_running and engine.num_requests == 0
        with pytest.raises(EngineClosed):
            engine.open("x", GREEDY)
        with pytest.raises(EngineClosed):
            await engine.utility("state")
        await engine.shutdown()

    run(main())


def test_a_core_that_cannot_start_says_why(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_family"}')
    with pytest.raises(EngineStartError, match="the engine did not start: .*no_such_family"):
        ProcessEngine(build_config(model=str(tmp_path), **ENGINE), str(tmp_path))


def test_the_core_exits_when_its_server_process_dies():
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.getcwd()!r})
        from moe_infer.assets import default_model_path
        from moe_infer.engine.core_client import ProcessEngine
        from moe_infer.engine.llm import build_config
        if __name__ == "__main__":
            engine = ProcessEngine(build_config(model=default_model_path(), **{ENGINE!r}), default_model_path())
            print(engine.core_pid, flush=True)
            os.kill(os.getpid(), 9)  # no cleanup of any kind
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the engine core outlived its server"
