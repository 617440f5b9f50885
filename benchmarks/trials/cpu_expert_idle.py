"""Trial (measurement notes, not a benchmark): one SwiGLU expert on the host cores, as the offload cost model
measures it at start-up and as the engine meets it.

The cost model's start-up figure (`moe_infer.offload.cost.CostModel.measure`) is the best of five back-to-back
runs of one expert: its weights hot in the CPU's caches, the intra-op threads spinning. In the engine a missed
expert's weights come cold from memory, after the host spent milliseconds launching GPU work, so the threads
have gone to sleep. For the Qwen3-30B-A3B shape (9.4 MB an expert) the engine measured up to 20-28x the start-up
figure (docs/offload.md). This times `moe_infer.offload.compute.swiglu` per call, median over the calls, for:
  the same expert back to back (the start-up way); a different expert each call (cold weights); and each with an
  idle gap before the call: the main thread asleep (time.sleep), or with --busy busy in Python (as the engine's
  main thread is, launching GPU work, while the intra-op threads wait). Run it under OMP_WAIT_POLICY=PASSIVE / ACTIVE
  to see what the threads' sleeping costs.

    python benchmarks/trials/cpu_expert_idle.py [--shape qwen3|mixtral] [--rows 2] [--experts 64] [--gaps 0,2,20] [--busy]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from moe_infer.offload.compute import swiglu  # noqa: E402

SHAPES = {"qwen3": (2048, 768), "mixtral": (4096, 14336)}  # (D, F)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64, help="distinct experts cycled through (their bytes exceed the caches)")
    ap.add_argument("--gaps", default="0,2,20", help="idle ms before each call")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--busy", action="store_true", help="the main thread spins in Python through each gap")
    args = ap.parse_args()
    D, F = SHAPES[args.shape]
    torch.manual_seed(0)
    w13 = [torch.randn(2 * F, D).to(torch.bfloat16) for _ in range(args.experts)]
    w2 = [torch.randn(D, F).to(torch.bfloat16) for _ in range(args.experts)]
    x = torch.randn(args.rows, D).to(torch.bfloat16)
    mb = (w13[0].numel() + w2[0].numel()) * 2 / 1e6
    print(f"{args.shape}: {mb:.1f} MB an expert, {args.rows} rows, {torch.get_num_threads()} intra-op threads, "
          f"{args.experts} experts, gaps {'busy' if args.busy else 'asleep'}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")

    def idle(gap_s: float) -> None:
        if not args.busy:
            time.sleep(gap_s)
            return
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass

    def run(gap_s: float, cycle: bool) -> float:
        times = []
        for i in range(args.calls):
            e = i % args.experts if cycle else 0
            if gap_s:
                idle(gap_s)
            t = time.perf_counter()
            swiglu(x, w13[e], w2[e])
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times[5:])

    for gap in (float(g) for g in args.gaps.split(",")):
        same, other = run(gap / 1e3, False), run(gap / 1e3, True)
        print(f"  idle {gap:5.1f} ms before each call: same expert {same:7.3f} ms ({mb / same:5.1f} GB/s), "
              f"another expert each call {other:7.3f} ms ({mb / other:5.1f} GB/s)")


if __name__ == "__main__":
    main()
