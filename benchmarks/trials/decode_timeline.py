"""Trial (measurement notes, not a benchmark): the GPU timeline of one batch-1 decode step of the 8-layer
Qwen3-30B-A3B-shaped engine. Prints the step rate of `generate`, the GPU time of one decode-graph replay,
every kernel of one replay in order (start offset, duration, gap before it), per-kernel-name totals per
replay, and, for decode steps inside `generate`, how the step's wall time splits into the graph, the
kernels outside it (LM head, sampling, input copies) and the GPU's idle time.

    python benchmarks/trials/decode_timeline.py [--layers 8] [--batch 1] [--out DIR]
"""
import argparse
import collections
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

import e2e_generate as e2e  # noqa: E402
from step_breakdown import decode_graph_replay_us, gen  # noqa: E402  (this folder)


def kernels_of(fn, path):
    """[(name, start us, dur us, in_graph)] of the CUDA kernels fn runs, from the profiler's trace."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    launches = {e["args"].get("correlation"): e["name"] for e in events
                if e.get("cat") == "cuda_runtime" and "args" in e}
    out = []
    for e in events:
        if e.get("cat") == "kernel":
            via = launches.get(e["args"].get("correlation"), "")
            out.append((e["name"], float(e["ts"]), float(e["dur"]), "Graph" in via))
    out.sort(key=lambda k: k[1])
    return out


def short(name, n=48):
    return name if len(name) <= n else name[:n - 3] + "..."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    from moe_infer import LLM
    dev = torch.device("cuda")
    dims = dict(e2e.REAL, num_hidden_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    ids = lambda b, n: torch.randint(2, dims["vocab_size"], (b, n), generator=g).tolist()  # noqa: E731
    B = args.batch
    tag = f"pdl{os.environ.get('MOE_FUSED_PDL', '1')}_rda{os.environ.get('MOE_ROPE_DECODE_ATTENTION', '1')}_b{B}"
    with tempfile.TemporaryDirectory() as ckpt:
        hf = e2e.build_checkpoint(dims, torch.bfloat16, dev, ckpt)
        del hf
        torch.cuda.empty_cache()
        llm = LLM(model=ckpt, dtype="bfloat16", device="cuda", max_num_seqs=max(B, 1),
                  max_num_batched_tokens=4096, max_model_len=1200, num_kv_blocks=64 * 300 // 16 + 200,
                  enable_prefix_caching=False)
        runner = llm.engine.runner
        gen(llm, ids(B, 128), 128)
        walls = [gen(llm, ids(B, 128), 128) for _ in range(3)]
        wall = sorted(walls)[1]
        print(f"\n=== [{tag}] decode batch {B}: {B * 128 / wall:.0f} tok/s, {1e3 * wall / 128:.3f} ms/step "
              f"(median of 3 generate calls, prompt 128, 128 new)", flush=True)
        key, graph, replay_us = decode_graph_replay_us(runner, B, 100)
        extra = "embedding, final norm and LM head" if runner.graphs.with_logits else "embedding and final norm"
        print(f"graph {key} replay GPU time {replay_us:.1f} us ({replay_us / args.layers:.1f} us a layer with the "
              f"{extra})", flush=True)
        ks = kernels_of(lambda: [graph.replay() for _ in range(3)], os.path.join(args.out, f"replay_{tag}.json"))
        per = len(ks) // 3
        one = ks[per:2 * per]  # the middle replay
        t0 = one[0][1]
        print(f"kernels per replay {per}; one replay, in order (offset, dur, gap before), layer 2 of {args.layers}:")
        per_layer = (per - 2) // args.layers if args.layers else per
        prev_end = None
        rows = []
        for i, (name, ts, dur, _) in enumerate(one):
            gap = 0.0 if prev_end is None else ts - prev_end
            prev_end = max(prev_end or 0.0, ts + dur)
            rows.append((name, ts - t0, dur, gap))
        for name, off, dur, gap in rows[1 + 2 * per_layer:1 + 3 * per_layer]:
            print(f"  {off:8.1f} {dur:7.2f} gap {gap:6.2f}  {short(name, 70)}")
        span = one[-1][1] + one[-1][2] - one[0][1]
        busy = sum(d for _, _, d, _ in one)
        gaps = sum(max(0.0, g) for _, _, _, g in rows)
        print(f"one replay: span {span:.1f} us, kernel time {busy:.1f} us, gaps {gaps:.1f} us (negative gaps: "
              "overlap under PDL)", flush=True)
        tot = collections.defaultdict(lambda: [0.0, 0])
        for name, _, dur, _ in one:
            tot[name][0] += dur
            tot[name][1] += 1
        print("per name, per replay (us, count):")
        for name, (d, n) in sorted(tot.items(), key=lambda kv: -kv[1][0]):
            print(f"  {d:8.1f} {n:4d}  {short(name, 80)}")
        # decode steps inside generate: the graph, the kernels outside it, the idle time
        ks = kernels_of(lambda: gen(llm, ids(B, 128), 24), os.path.join(args.out, f"generate_{tag}.json"))
        graph_starts = [i for i, k in enumerate(ks) if k[3] and (i == 0 or not ks[i - 1][3])]
        print(f"\ngenerate (prompt 128, 24 new): {len(graph_starts)} graph replays")
        splits = []
        for a, b in zip(graph_starts[4:-2], graph_starts[5:-1]):
            step = ks[a:b]
            wall_us = ks[b][1] - ks[a][1]
            in_graph = sum(d for _, _, d, g in step if g)
            outside = [(n, d) for n, _, d, g in step if not g]
            splits.append((wall_us, in_graph, sum(d for _, d in outside), outside))
        for wall_us, in_graph, out_us, outside in splits[:3]:
            print(f"step: graph start to next graph start {wall_us:.1f} us; kernels in graph {in_graph:.1f}, "
                  f"outside {out_us:.1f} ({len(outside)} kernels), idle or overlap {wall_us - in_graph - out_us:.1f}")
            for n, d in outside:
                print(f"    {d:7.2f}  {short(n, 80)}")
        if splits:
            med = sorted(splits, key=lambda x: x[0])[len(splits) // 2]
            print(f"median step {med[0]:.1f} us: graph kernels {med[1]:.1f}, outside {med[2]:.1f}, "
                  f"rest {med[0] - med[1] - med[2]:.1f}", flush=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
