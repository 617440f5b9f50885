"""Trial (measurement notes, not a benchmark): where the time to first token of one prompt goes, on one
timeline. The 8-layer Qwen3-30B-A3B-shaped engine of benchmarks/engine_roofline.py (same engine keywords)
runs `generate(1 x n, max_tokens=1)` under torch.profiler with the engine's phases annotated; the script
reads the trace back and prints, relative to the call's start: each phase's host span, the first and last
GPU activity, the GPU busy time (union of kernels and copies) and its idle gaps, and the host tail after the
last GPU activity. TTFT without the profiler (median of 7) is printed first.

Then, without the profiler (`--phases`, median of 15 calls): each phase's host start and duration by
perf_counter wrappers (about a microsecond each), and the host time of each graph launch.

    python benchmarks/trials/ttft_timeline.py [--layers 8] [--lens 128,1024] [--out DIR] [--phases]
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

import e2e_generate as e2e  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def annotate(obj, name: str, label: str):
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        with torch.profiler.record_function(label):
            return fn(*a, **k)

    setattr(obj, name, wrapped)
    return lambda: setattr(obj, name, fn)


def timed(obj, name: str, label: str, log: list, t0: list):
    """Wraps obj.name to append (label, start, duration) in seconds since t0[0] to log (no profiler)."""
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            log.append((label, start - t0[0], time.perf_counter() - start))

    setattr(obj, name, wrapped)
    return lambda: setattr(obj, name, fn)


def phase_table(runs: list) -> list:
    """Per (label, occurrence) across runs: median start and duration in microseconds."""
    keyed = {}
    for log in runs:
        seen = {}
        for label, start, dur in log:
            i = seen[label] = seen.get(label, -1) + 1
            keyed.setdefault((label, i), []).append((start, dur))
    rows = [(statistics.median(s for s, _ in v) * 1e6, statistics.median(d for _, d in v) * 1e6, label, i)
            for (label, i), v in keyed.items() if len(v) == len(runs)]
    return sorted(rows)


def union_us(spans):
    spans = sorted(spans)
    total, gaps, cur_s, cur_e = 0.0, [], None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
                gaps.append((cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total, gaps


def kernel_totals(gpu) -> list:
    """(total us, calls, name) per GPU activity name, largest first."""
    acc = {}
    for s, e, name in gpu:
        tot, calls = acc.get(name, (0.0, 0))
        acc[name] = (tot + e - s, calls + 1)
    return sorted(((round(tot, 1), calls, name[:70]) for name, (tot, calls) in acc.items()), reverse=True)


def timeline(trace_path: str, top: int = 8) -> dict:
    events = json.load(open(trace_path))["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X"]
    gen = [e for e in xs if e.get("name") == "ttft:generate"]
    t0, t1 = gen[0]["ts"], gen[0]["ts"] + gen[0]["dur"]
    gpu = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in xs
           if e.get("cat") in GPU_CATS and t0 <= e["ts"] <= t1 + 1e5]
    phases = sorted(((e["ts"] - t0, e["dur"], e["name"][5:]) for e in xs
                     if e.get("cat") == "user_annotation" and e["name"].startswith("ttft:") and t0 <= e["ts"] <= t1),
                    key=lambda p: p[0])
    busy, gaps = union_us([(s, e) for s, e, _ in gpu])
    first, last = min(s for s, _, _ in gpu), max(e for _, e, _ in gpu)
    cpu_ops = [e for e in xs if e.get("cat") == "cpu_op" and t0 <= e["ts"] <= first]
    return dict(
        wall_us=t1 - t0, gpu_first_us=first - t0, gpu_last_us=last - t0, gpu_busy_us=busy,
        gpu_span_us=last - first, host_tail_us=t1 - last,
        phases=[dict(start_us=round(s, 1), dur_us=round(d, 1), name=n) for s, d, n in phases],
        gaps=[dict(at_us=round(a - t0, 1), len_us=round(b - a, 1))
              for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]],
        gpu_first_names=[n for _, _, n in sorted(gpu)[:6]],
        kernels=kernel_totals(gpu)[:16],
        cpu_ops_before_gpu=sorted(((round(e["dur"], 1), e["name"]) for e in cpu_ops), reverse=True)[:top],
        runtime_calls=[dict(at_us=round(e["ts"] - t0, 1), dur_us=round(e["dur"], 1), name=e["name"]) for e in xs
                       if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t1 and e["dur"] >= 20],
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lens", default="128,1024")
    ap.add_argument("--out", default=None)
    ap.add_argument("--phases", action="store_true", help="also time the phases without the profiler")
    args = ap.parse_args()
    from moe_infer import LLM, SamplingParams
    from moe_infer.engine import model_runner as mr

    dev = torch.device("cuda")
    dims = dict(e2e.REAL, num_hidden_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, dims["vocab_size"], (1, n), generator=g).tolist()[0]  # noqa: E731
    lens = [int(v) for v in args.lens.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out_dir = args.out or tempfile.mkdtemp(prefix="ttft_timeline_")
    result = {}
    with tempfile.TemporaryDirectory() as ckpt:
        hf = e2e.build_checkpoint(dims, torch.bfloat16, dev, ckpt)
        del hf
        torch.cuda.empty_cache()
        # engine_roofline.py's keywords at its defaults (batches 1,16,64; 128 + 128; prefill 16 x 1024)
        longest = max(128 + 128, 1024 + 1, max(lens) + 1) + 16
        llm = LLM(model=ckpt, dtype="bfloat16", device="cuda", max_num_seqs=64, max_num_batched_tokens=16 * 1024,
                  max_model_len=longest, num_kv_blocks=max(64 * 272, 16 * 1040) // 16 + 64, enable_prefix_caching=False)
        eng, runner = llm.engine, llm.engine.runner

        def gen(n):
            prompt = ids(n)  # made before the clock starts, as engine_roofline.py does
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.profiler.record_function("ttft:generate"):
                llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            return time.perf_counter() - t

        for n in lens:
            for _ in range(3):
                gen(n)
            plain = statistics.median(gen(n) for _ in range(7))
            undo = [annotate(eng, "add_request", "ttft:add_request"), annotate(eng, "step", "ttft:step"),
                    annotate(eng.scheduler, "schedule", "ttft:schedule"), annotate(runner, "prepare", "ttft:prepare"),
                    annotate(mr, "flat_inputs", "ttft:flat_inputs"),
                    annotate(runner, "_sample", "ttft:sample"),
                    annotate(runner.model, "compute_logits", "ttft:lm_head"),
                    annotate(runner, "collect", "ttft:collect"),
                    annotate(eng.scheduler, "postprocess", "ttft:postprocess"),
                    annotate(eng.executor, "finish", "ttft:finish")]
            if runner.extend_graphs is not None:  # "replay" since graph_inputs.py (the inputs: in prepare), "run" before
                name = "replay" if hasattr(runner.extend_graphs, "replay") else "run"
                undo.append(annotate(runner.extend_graphs, name, "ttft:graph_run"))
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                gen(n)
                torch.cuda.synchronize()
            for u in undo:
                u()
            path = os.path.join(out_dir, f"ttft_trace_{n}.json")
            prof.export_chrome_trace(path)
            tl = timeline(path)
            tl["ttft_plain_ms"] = 1e3 * plain
            result[n] = tl
            print(f"\n=== 1 x {n}: TTFT (no profiler, median of 7) {1e3 * plain:.2f} ms; under the profiler "
                  f"{tl['wall_us'] / 1e3:.2f} ms: "
                  f"first GPU activity at {tl['gpu_first_us']:.0f} us, last at {tl['gpu_last_us']:.0f} us, GPU busy "
                  f"{tl['gpu_busy_us']:.0f} us of a {tl['gpu_span_us']:.0f} us span, "
                  f"host tail {tl['host_tail_us']:.0f} us")
            for p in tl["phases"]:
                print(f"  {p['start_us']:8.1f} +{p['dur_us']:8.1f} us  {p['name']}")
            print("  largest GPU idle gaps:", ", ".join(f"{g['len_us']} us at {g['at_us']}" for g in tl["gaps"]))
            print("  first GPU work:", tl["gpu_first_names"])
            print("  GPU time by kernel (us, calls):", "; ".join(f"{n} {t} x{c}" for t, c, n in tl["kernels"]))
            print("  longest CPU ops before the first GPU work:", tl["cpu_ops_before_gpu"])
            print("  CUDA runtime calls >= 20 us:", ", ".join(f"{c['name']} {c['dur_us']} us at {c['at_us']}"
                                                         for c in tl["runtime_calls"]))
            if args.phases:
                log, t0, runs = [], [0.0], []
                targets = [(eng, "add_request"), (eng, "step"), (eng.scheduler, "schedule"), (runner, "prepare"),
                           (mr, "flat_inputs"), (runner, "_sample"), (runner.model, "compute_logits"),
                           (runner.sampler, "sample"), (runner, "collect"), (eng.scheduler, "postprocess"),
                           (eng.executor, "finish")]
                if runner.extend_graphs is not None:
                    targets += [(runner.extend_graphs, "load"), (runner.extend_graphs, "replay")]
                undo = [timed(o, name, name, log, t0) for o, name in targets]
                for _ in range(15):
                    log.clear()
                    prompt = ids(n)
                    torch.cuda.synchronize()
                    t0[0] = time.perf_counter()
                    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                    log.append(("generate", 0.0, time.perf_counter() - t0[0]))
                    runs.append(list(log))
                for u in undo:
                    u()
                table = phase_table(runs)
                result[n]["phases_no_profiler"] = [{"start_us": round(a, 1), "dur_us": round(d, 1), "name": f"{lb}#{i}"}
                                                   for a, d, lb, i in table]
                print("  phases without the profiler (median of 15; start, duration in us; #k: k-th call):")
                for a, d, lb, i in table:
                    print(f"  {a:8.1f} +{d:8.1f} us  {lb}#{i}")
        # host time of one replay() call per decode graph (the device idle before and after); their buffers hold the
        # warm-up's inputs. A prefill bucket's graph is timed by the replay phase above only: its inputs share one
        # buffer laid out per bucket, so replaying a bucket other than the last one loaded reads another layout
        # (KV slots and block ids out of range: an illegal address)
        replay = {}
        for key, (graphs, _) in sorted((runner.graphs.graphs if runner.graphs is not None else {}).items()):
            host = []
            for _ in range(7):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for graph in graphs:
                    graph.replay()
                host.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            replay[f"decode {key}"] = 1e6 * statistics.median(host)
        print("\nhost time of graph.replay() (median of 7, idle device):",
              ", ".join(f"{k}: {v:.0f} us" for k, v in replay.items()))
        result["replay_host_us"] = replay
        llm.shutdown()
    with open(os.path.join(out_dir, "ttft_timeline.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), layers=args.layers, result=result), f, indent=1)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
