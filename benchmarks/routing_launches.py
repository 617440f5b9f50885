"""Where the routing microseconds go: device time of each kernel launch of the Triton pipeline
(torch.profiler, CUDA activity) and the gate kernel at several launch shapes (CUDA-graph medians).

Usage (GPU): python benchmarks/routing_launches.py [--out DIR]. Prints tables, writes
routing_launches_<device>.json. Legend: T tokens, E experts, K top-k.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.routing import BLOCK_SIZE, MODELS  # noqa: E402
from moe_infer.routing.triton_permute import permute_rows_triton  # noqa: E402
from moe_infer.routing.triton_route import route_rows_triton  # noqa: E402
from moe_infer.routing.triton_select import launch_gate, select_experts_triton  # noqa: E402


def kernel_times(fn, iters=20):
    """{kernel name: mean device us per call} over `iters` calls after a warm-up."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {k: v / iters for k, v in total.items()}


def gate_variant(x_TE, spec, bias_E, block_t, num_warps):
    T, K = x_TE.shape[0], spec.top_k
    w = torch.empty(T, K, dtype=torch.float32, device=x_TE.device)
    ids = torch.empty(T, K, dtype=torch.int32, device=x_TE.device)
    return lambda: launch_gate(x_TE, spec, bias_E, w, ids, block_t, num_warps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="T=8192 only, no gate launch-shape sweep")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    result = dict(device=dev, launches=[], gate_shapes=[])
    for name, spec in MODELS.items():
        for T in (8192,) if "--quick" in sys.argv else (256, 8192):
            gen = torch.Generator(device="cuda").manual_seed(T)
            E = spec.num_experts
            x_TE = torch.randn(T, E, device="cuda", generator=gen).to(torch.bfloat16)
            bias_E = torch.randn(E, device="cuda", generator=gen) * 0.05 if spec.has_score_bias else None

            def two_step():
                w, ids = select_experts_triton(x_TE, spec, bias_E)
                return permute_rows_triton(ids, w, E, 0, BLOCK_SIZE)
            tunings = {"fused": {}, "fused_scatter128": dict(rows_per_scatter=128), "fused_group256": dict(group_rows=256),
                       "fused_wide": dict(wide_gate=True)}
            pipes = [(label, lambda kw=kw: route_rows_triton(x_TE, spec, bias_E, BLOCK_SIZE, **kw))
                     for label, kw in tunings.items()] + [("two_step", two_step)]
            for label, pipe in pipes:
                times = kernel_times(pipe)
                total = 1000 * do_bench_cudagraph(pipe, rep=20, return_mode="median")
                result["launches"].append(dict(model=name, T=T, pipeline=label, graph_us=total, kernels_us=times))
                print(f"{name:16s} T={T:5d} {label:8s} graph {total:6.1f}us  " + "  ".join(
                    f"{k.split('_kernel')[0][-14:]}={v:.1f}" for k, v in times.items()), flush=True)
            if T != 8192 or "--quick" in sys.argv:
                continue
            for bt, nw in ((2, 1), (4, 1), (8, 4), (16, 8), (32, 16)):
                if bt * triton.next_power_of_2(E) > 16384:
                    continue
                us = 1000 * do_bench_cudagraph(gate_variant(x_TE, spec, bias_E, bt, nw), rep=20, return_mode="median")
                result["gate_shapes"].append(dict(model=name, T=T, block_t=bt, num_warps=nw, us=us))
                print(f"   gate BT={bt:3d} warps={nw:2d}: {us:6.1f} us", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"routing_launches_{re.sub(r'[^a-z0-9]+', '_', dev.lower()).strip('_')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("->", path)


if __name__ == "__main__":
    main()
