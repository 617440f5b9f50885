"""The load of benchmarks/serving.py: servebench prompts, the warm-up, the request-rate sweep, and the
saturation level repeated (`Repeated`: the median pass) or dealt over K load generator processes that
start together (`split_level` -> `MergedLevel`, one servebench level over every request).
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time


def prompts_from(ckpt: str, n: int, input_len: int, seed: int):
    from servebench.prompts import synthetic

    return synthetic(n, input_len, seed=seed, tokenizer=ckpt)


def warm_load(ckpt: str, args) -> list:
    """max_num_seqs prompts whose output lengths spread over 8..OUTPUT: decode batches of every size."""
    ps = prompts_from(ckpt, args.max_num_seqs, args.input_len, seed=99)
    n = len(ps)
    return [(p.text, 8 + (args.output_len - 8) * i // max(n - 1, 1)) for i, p in enumerate(ps)]


async def warm_server(base_url: str, warm: list) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async def one(text, n):
            async with s.post(f"{base_url}/completions", json=dict(model="bench", prompt=text, max_tokens=n,
                                                                   ignore_eos=True, temperature=0)) as r:
                assert r.status == 200, await r.text()
                await r.read()

        await asyncio.gather(*(one(t, n) for t, n in warm))


async def sweep(base_url: str, ckpt: str, args, rates: list, saturation_sets: list) -> list:
    """servebench at each rate; rate=inf once per saturation prompt set, as its median level (`Repeated`)."""
    from servebench.client import RequestSpec
    from servebench.load import run_level
    from servebench.tokens import make_counter

    spec = RequestSpec(url=base_url, model="bench", endpoint="completions", output_len=args.output_len,
                       ignore_eos=True, temperature=0.0)
    counter = make_counter(ckpt)
    levels = []
    for i, rate in enumerate(rates):
        if rate != float("inf"):
            prompts = prompts_from(ckpt, max(16, int(rate * args.level_s)), args.input_len, seed=1000 + i)
            level = await run_level(spec, prompts, "rate", rate, seed=i, timeout=600, counter=counter,
                                    slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
        else:  # once per --client-procs value, the first one's level is the row's
            for k in args.client_procs:
                runs = []
                for prompts in saturation_sets:
                    if k > 1:
                        runs.append(await asyncio.get_running_loop().run_in_executor(None, split_level, base_url,
                                                                                     ckpt, args, prompts, k))
                    else:
                        runs.append(await run_level(spec, prompts, "rate", rate, seed=i, timeout=600, counter=counter,
                                                    slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms))
                level = Repeated(runs)
                level.client_procs = k
                levels.append(level)
                print(f"  rate inf, {k} client process(es): {level.summary.output_throughput:.0f} tok/s", flush=True)
            continue
        levels.append(level)
        print(f"  rate {rate:g} req/s: {level.summary.output_throughput:.0f} tok/s", flush=True)
    return levels


class Repeated:
    """The median (by output tok/s) of several runs of a level, with every run's output tok/s."""

    def __init__(self, runs: list) -> None:
        median = sorted(runs, key=lambda r: r.summary.output_throughput)[len(runs) // 2]
        self.summary, self.requests, self.client_lag_p99_ms = median.summary, median.requests, median.client_lag_p99_ms
        self.start_spread_s = getattr(median, "start_spread_s", None)
        self.repeats_output_tok_s = [r.summary.output_throughput for r in runs]


class MergedLevel:
    """A rate=inf level run by several client processes, as one servebench level (summary over every
    request; the duration from the common start to the last finish)."""

    def __init__(self, parts: list, args) -> None:
        from servebench.metrics import summarize
        from servebench.results import RequestResult

        t0 = min(start for start, _, _, _ in parts)
        self.requests, end = [], 0.0
        for start, duration, requests, _ in parts:
            for r in requests:
                r = RequestResult.model_validate(r)
                r.start += start - t0
                self.requests.append(r)
            end = max(end, start - t0 + duration)
        self.requests.sort(key=lambda r: r.start)
        self.client_lag_p99_ms = max((lag for _, _, _, lag in parts if lag is not None), default=None)
        self.start_spread_s = max(start for start, _, _, _ in parts) - t0  # how far apart the clients began
        self.summary = summarize(self.requests, end, args.slo_ttft_ms, args.slo_tpot_ms)


def split_level(base_url: str, ckpt: str, args, prompts, k: int) -> MergedLevel:
    """The saturation level with its requests dealt over k load generator processes that start together:
    one asyncio client streaming every token of hundreds of requests can itself be the bound."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ready = ctx.Barrier(k)  # every process set up (imports, tokenizer) before any sends
    procs = [ctx.Process(target=_client_part, args=(base_url, ckpt, args.output_len, list(prompts)[i::k], ready,
                                                    queue)) for i in range(k)]
    for proc in procs:
        proc.start()
    parts = [queue.get(timeout=900) for _ in procs]
    for proc in procs:
        proc.join(60)
    return MergedLevel(parts, args)


def _client_part(base_url: str, ckpt: str, output_len: int, prompts, ready, queue) -> None:
    from servebench.client import RequestSpec
    from servebench.load import run_level
    from servebench.tokens import make_counter

    spec = RequestSpec(url=base_url, model="bench", endpoint="completions", output_len=output_len,
                       ignore_eos=True, temperature=0.0)
    counter = make_counter(ckpt)
    ready.wait(timeout=300)
    start = time.time()
    level = asyncio.run(run_level(spec, prompts, "rate", float("inf"), timeout=600, counter=counter))
    queue.put((start, level.duration, [r.model_dump() for r in level.requests], level.client_lag_p99_ms))
