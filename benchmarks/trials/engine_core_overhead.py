"""Trial (measurement notes): where the server loses throughput against the offline engine. serving.py's
saturation load (N prompts at once), timed in one process each, after a warm-up pass of a load of the same shape (other prompts: no prefix-cache hits), --repeats
timed passes with prompts of their own, the median reported:

    offline      LLM.generate (final outputs only)
    step         LLMEngine.step() in a loop: every request's cumulative output built every step, as a server needs
    deltas       LLMEngine.step(encoder=...) in a loop: the deltas the engine core sends, pickled, no process
    process      ProcessEngine: the engine core process and its pipe, asyncio readers, no HTTP

    python benchmarks/trials/engine_core_overhead.py     # H100: ~3 min
"""
import argparse
import asyncio
import json
import os
import pickle
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))


def _timed(mode, ckpt, kw, warm, prompt_sets, output_len, queue):
    import torch

    sync = torch.cuda.synchronize if kw["device"] != "cpu" else (lambda: None)
    from moe_infer import LLM, SamplingParams
    from moe_infer.engine.llm import build_config
    from moe_infer.engine.output_delta import DeltaEncoder

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)

    def once_sync(llm, prompts):
        eng = llm.engine
        enc = DeltaEncoder() if mode == "deltas" else None
        for i, p in enumerate(prompts):
            eng.add_request(p, params, str(i) + str(time.perf_counter()))
        n = 0
        start = time.perf_counter()
        while eng.has_unfinished_requests():
            outs = eng.step(encoder=enc)
            if enc is not None:
                pickle.dumps(outs)
            n += 1
        sync()
        return time.perf_counter() - start, n

    if mode == "offline":
        llm = LLM(model=ckpt, **kw)
        llm.generate(warm, params, use_tqdm=False)
        elapsed = []
        for prompts in prompt_sets:
            sync()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            sync()
            elapsed.append(time.perf_counter() - start)
        steps = None
    elif mode in ("step", "deltas"):
        llm = LLM(model=ckpt, **kw)
        once_sync(llm, warm)
        passes = [once_sync(llm, prompts) for prompts in prompt_sets]
        elapsed, steps = [e for e, _ in passes], passes[0][1]
    else:
        from moe_infer.engine.core_client import ProcessEngine

        engine = ProcessEngine(build_config(model=ckpt, **kw), ckpt, max_requests=len(prompt_sets[0]) + 8)

        async def run():
            await engine.start()

            async def one(p):
                async for out in engine.generate(p, params):
                    pass
                return out

            await asyncio.gather(*(one(p) for p in warm))
            elapsed = []
            for prompts in prompt_sets:
                start = time.perf_counter()
                await asyncio.gather(*(one(p) for p in prompts))
                elapsed.append(time.perf_counter() - start)
            await engine.shutdown()
            return elapsed

        elapsed, steps = asyncio.run(run()), None
        engine.close()
    tok_s = sorted(len(prompts) * output_len / e for prompts, e in zip(prompt_sets, elapsed))
    queue.put(dict(mode=mode, tok_s=tok_s[len(tok_s) // 2], passes_tok_s=tok_s, elapsed_s=elapsed, steps=steps))


def main():
    import serving
    from e2e_generate import REAL, TINY

    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="offline,step,deltas,process")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per mode (own prompts each): the median")
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU: a smoke run")
    args = ap.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    rows = []
    with tempfile.TemporaryDirectory(prefix="core_overhead_") as ckpt:
        proc, _ = serving.run_child(serving._build, dict(TINY if args.tiny else REAL, vocab_size=6144),
                                        args.device, ckpt)
        proc.join()
        prompt_sets = [[p.text for p in serving.prompts_from(ckpt, args.num_requests, args.input_len, seed=9 + r)]
                       for r in range(args.repeats)]
        warm = [p.text for p in serving.prompts_from(ckpt, args.num_requests, args.input_len, seed=8)]
        for mode in args.modes.split(","):
            proc, queue = serving.run_child(_timed, mode, ckpt, serving.engine_kwargs(args), warm, prompt_sets,
                                            args.output_len, with_queue=True)
            row = queue.get(timeout=600)
            proc.join()
            rows.append(row)
            print(f"{mode:>8}: {row['tok_s']:8.0f} output tok/s, median of {args.repeats} "
                  f"({', '.join(f'{v:.0f}' for v in row['passes_tok_s'])}; steps {row['steps']})", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
