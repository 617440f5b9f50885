"""Trial (measurement notes): does a fused-MoE point time faster right after the GPU idled than under sustained load?

`graph_time_us` (moe_infer/kernels/fused_moe_bench.py) replays a CUDA graph 3 times untimed and then times
`num_replays` replays (median). gate_up_body_ab.py saw the first timing of a long compute-bound point read 5-10 %
faster than later timings of the same kernel. Here each point of benchmarks/fused_moe.py's shapes is timed, in
alternation, (a) "cold": after the GPU idled for --idle-s seconds, and (b) "warm": right after --warm-ms of replays
of the same graph; the SM clock, board power, temperature and clock event reasons (nvidia-smi) are read after each
timing (the first run, at d3c71b4, read the clock and the power only).

    python benchmarks/trials/timing_warmup.py [--tokens 1,128,2048,8192] [--rounds 3] [--out DIR]   # ~2 min on an H200
Writes timing_warmup_<device>.json to --out, else $OUT, else benchmarks/results/trials/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import torch  # noqa: E402

from moe_infer.kernels.fused_moe import fused_experts  # noqa: E402
from moe_infer.kernels.fused_moe_bench import (  # noqa: E402
    MODEL_SHAPES, make_inputs, make_weights, replay_time_us, roofline_us,
)
from moe_infer.kernels.fused_moe_config import device_name  # noqa: E402


QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def gpu_state() -> str:
    """SM clock (MHz), board power (W), temperature (C) and the active clock event reasons (a bit mask: 0x4 the
    software power cap, 0x20 / 0x40 software / hardware thermal slowdown, 0x8 hardware slowdown), as nvidia-smi
    reports them now ('' where it cannot)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        return out[torch.cuda.current_device()] if out else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(MODEL_SHAPES))
    ap.add_argument("--tokens", default="1,128,2048,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=1.0)
    ap.add_argument("--warm-ms", type=float, default=300.0)
    ap.add_argument("--replays", type=int, default=30, help="timed replays per timing (as benchmarks/fused_moe.py)")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "..", "results", "trials")))
    args = ap.parse_args()
    rows = []
    print(f"{'shape':14s} {'T':>5s} {'roof us':>8s} {'cold us':>9s} {'warm us':>9s} {'warm/cold':>9s}  {QUERY} cold | warm")
    for name in args.shapes.split(","):
        E, K, D, F = MODEL_SHAPES[name]
        w13, w2 = make_weights(E, D, F)
        for T in map(int, args.tokens.split(",")):
            x, ids, w = make_inputs(T, E, K, D, seed=T)
            fused_experts(x, ids, w, w13, w2)  # compile, allocate
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fused_experts(x, ids, w, w13, w2)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            per_replay_s = max(time.perf_counter() - t0, 1e-6)
            warm_replays = max(1, int(args.warm_ms / 1e3 / per_replay_s))
            cold, warm, cold_state, warm_state = [], [], [], []
            for _ in range(args.rounds):
                time.sleep(args.idle_s)
                cold.append(replay_time_us(graph, args.replays))
                cold_state.append(gpu_state())
                for _ in range(warm_replays):
                    graph.replay()
                warm.append(replay_time_us(graph, args.replays))
                warm_state.append(gpu_state())
            c, h = statistics.median(cold), statistics.median(warm)
            rows.append({"shape": name, "tokens": T, "roofline_us": roofline_us(ids, E, D, F), "cold_us": cold,
                         "warm_us": warm, "cold_state": cold_state, "warm_state": warm_state,
                         "warm_replays": warm_replays})
            print(f"{name:14s} {T:5d} {rows[-1]['roofline_us']:8.1f} {c:9.1f} {h:9.1f} {h / c:9.3f}  "
                  f"{cold_state[-1]} | {warm_state[-1]}", flush=True)
            del graph
        del w13, w2
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"timing_warmup_{device_name()}.json")
    with open(path, "w") as f:
        json.dump({"device": device_name(), "torch": torch.__version__, "git_commit": os.environ.get("GIT_COMMIT"),
                   "args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
