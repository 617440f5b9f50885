"""Trial (measurement notes, not a benchmark): where the 8-layer Qwen3-30B-A3B-shaped engine's step time
goes on the GPU: per decode step the host phases (schedule, prepare, forward launch, sample, postprocess),
the GPU time of one decode-graph replay, a kernel table of the replayed graph, and the host vs GPU time of
one eager 1 x 1024 prefill forward.

    python benchmarks/trials/step_breakdown.py [--layers 8] [--batches 1,16,64]
"""
import argparse
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

import e2e_generate as e2e  # noqa: E402


def wrap(obj, name, acc, sync=False):
    fn = getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        if sync:
            torch.cuda.synchronize()
        acc[name] += time.perf_counter() - t0
        return out

    setattr(obj, name, timed)
    return lambda: setattr(obj, name, fn)


def gen(llm, prompts, new):
    from moe_infer import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def kernel_table(fn, rows=22):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def decode_graph_replay_us(runner, batch, replays):
    """(key, graph, us): the decode graph a batch of `batch` replays (its smallest padded batch, longest
    context bucket) and its GPU time per replay, over `replays` replays after 5 warm-up ones."""
    keys = sorted(k for k in runner.graphs.graphs if k[0] >= batch)
    key = max((k for k in keys if k[0] == keys[0][0]), key=lambda k: k[1])
    graphs, _ = runner.graphs.graphs[key]
    graph = graphs[0] if isinstance(graphs, list) else graphs  # a list since the prefill graphs' split
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graph.replay()
    s.record()
    for _ in range(replays):
        graph.replay()
    e.record()
    torch.cuda.synchronize()
    return key, graph, 1e3 * s.elapsed_time(e) / replays


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,16,64")
    args = ap.parse_args()
    from moe_infer import LLM
    dev = torch.device("cuda")
    dims = dict(e2e.REAL, num_hidden_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    ids = lambda b, n: torch.randint(2, dims["vocab_size"], (b, n), generator=g).tolist()  # noqa: E731
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as ckpt:
        hf = e2e.build_checkpoint(dims, torch.bfloat16, dev, ckpt)
        del hf
        torch.cuda.empty_cache()
        llm = LLM(model=ckpt, dtype="bfloat16", device="cuda", max_num_seqs=max(batches),
                  max_num_batched_tokens=16384, max_model_len=1200, num_kv_blocks=64 * 300 // 16 + 200,
                  enable_prefix_caching=False)
        eng, runner = llm.engine, llm.engine.runner
        for b in batches:
            gen(llm, ids(b, 128), 128)
            acc = collections.Counter()
            undo = [wrap(eng.scheduler, "schedule", acc), wrap(runner, "prepare", acc),
                    wrap(runner.graphs, "replay", acc), wrap(runner, "_sample", acc),
                    wrap(eng.scheduler, "postprocess", acc), wrap(runner, "collect", acc),  # collect: the wait
                    wrap(eng, "step", acc)]  # for the step in flight (async scheduling)
            wall = gen(llm, ids(b, 128), 128)
            for u in undo:
                u()
            steps = 128
            print(f"\n=== decode batch {b}: {b * 128 / wall:.0f} tok/s, {1e3 * wall / steps:.3f} ms/step; "
                  "per step (host wall, no extra syncs): " + ", ".join(
                      f"{k} {1e3 * v / steps:.3f} ms" for k, v in acc.items()), flush=True)
            key, graph, replay_us = decode_graph_replay_us(runner, b, 50)
            print(f"graph {key} replay GPU time {replay_us / 1e3:.3f} ms", flush=True)
            if b in (1, 64):
                print(kernel_table(lambda: [graph.replay() for _ in range(10)]), flush=True)
                print(kernel_table(lambda: gen(llm, ids(b, 128), 8), rows=14), flush=True)
        # eager prefill 1 x 1024 / 1 x 128: host time of the forward vs GPU time
        for n in (128, 1024):
            gen(llm, ids(1, n), 1)
            acc = collections.Counter()
            model = runner.model
            fwd = model.forward
            host, gpu = [], []

            def timed_forward(*a, **k):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                s.record()
                out = fwd(*a, **k)
                e.record()
                host.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                gpu.append(s.elapsed_time(e) / 1e3)
                return out

            model.forward = timed_forward
            undo = [wrap(eng.scheduler, "schedule", acc), wrap(runner, "prepare", acc), wrap(runner, "_sample", acc),
                    wrap(eng, "step", acc)]
            walls = [gen(llm, ids(1, n), 1) for _ in range(5)]
            for u in undo:
                u()
            model.forward = fwd
            fwd_note = (f"eager forward host {1e3 * sorted(host)[len(host) // 2]:.2f} ms, GPU "
                        f"{1e3 * sorted(gpu)[len(gpu) // 2]:.2f} ms" if host else "forward replayed as a CUDA graph")
            print(f"\n=== prefill 1 x {n}: TTFT median {1e3 * sorted(walls)[2]:.2f} ms; {fwd_note}; per call: " + ", ".join(
                      f"{k} {1e3 * v / 5:.2f} ms" for k, v in acc.items()), flush=True)
            print(kernel_table(lambda: gen(llm, ids(1, n), 1), rows=30), flush=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
