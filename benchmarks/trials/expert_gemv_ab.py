"""Trial (measurement notes, not a benchmark): the experts of a one-token step, the tile GEMMs (gate_up,
down, combine) against the matrix-vector kernels of moe_infer/kernels/expert_gemv.py over their tiles.

Each point is a CUDA graph of REPS expert calls back to back, each on its own set of K experts (disjoint
sets while E allows, so the graph reads more bytes than L2 holds, as a decode step's layers do), divided
by REPS: the time a layer's experts take in a decode graph, launch gaps and PDL overlap included. The
roofline is the K experts' weight bytes at 3.0 TB/s. Shapes: the four model shapes of benchmarks/fused_moe.py.

    python benchmarks/trials/expert_gemv_ab.py [--shapes qwen3-30b-a3b,...] [--quick]
"""
import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from moe_infer.kernels.expert_gemv import expert_gemv, gemv_config  # noqa: E402
from moe_infer.kernels.fused_moe import fused_experts, launch_config  # noqa: E402
from moe_infer.kernels.fused_moe_bench import HBM_BYTES_PER_S, MODEL_SHAPES, graph_time_us, make_weights  # noqa: E402

REPS = 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(MODEL_SHAPES))
    ap.add_argument("--quick", action="store_true", help="the rule's tiles only")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}; us per layer's experts at T=1 (graph of {REPS} calls on distinct "
          f"experts / {REPS}); roofline = K experts' bytes / {HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    for name in args.shapes.split(","):
        E, K, D, F = MODEL_SHAPES[name]
        if name == "deepseek-v3":
            E = 64  # an EP rank's 64 of 256 experts (memory)
        w13, w2 = make_weights(E, D, F)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        perm = torch.randperm(E, device="cuda", generator=gen)
        ids = [perm[(r * K + torch.arange(K, device="cuda")) % E].int()[None] for r in range(REPS)]
        wts = [torch.softmax(torch.randn(1, K, device="cuda", generator=gen), -1) for _ in range(REPS)]
        roof = K * 3 * D * F * 2 / HBM_BYTES_PER_S * 1e6
        tile_cfg = launch_config(1, K, w13)
        ref = fused_experts(x, ids[0], wts[0], w13, w2, 0, tile_cfg)

        def timed(fn):
            return graph_time_us(lambda: [fn(ids[r], wts[r]) for r in range(REPS)], num_replays=20) / REPS

        tile = timed(lambda i, w: fused_experts(x, i, w, w13, w2, 0, tile_cfg))
        print(f"\n{name} (E={E} K={K} D={D} F={F}): roofline {roof:.1f} us; tile GEMMs {tile:.1f} us "
              f"({roof / tile:.0%})")
        base = gemv_config(D, F, K)
        cands = [base]
        if not args.quick:
            cands += [dataclasses.replace(base, **kw) for kw in (
                dict(block_d=max(1, base.block_d // 2)), dict(block_d=base.block_d * 2), dict(block_f=2),
                dict(block_f=8), dict(block_k=min(1024, base.block_k)), dict(num_warps=8))]
        for cfg in dict.fromkeys(cands):
            out = expert_gemv(x, ids[0], wts[0], w13, w2, 0, cfg)
            same = (out == ref).float().mean().item()
            us = timed(lambda i, w, c=cfg: expert_gemv(x, i, w, w13, w2, 0, c))
            tag = " (rule)" if cfg == base else ""
            print(f"  gemv {cfg}{tag}: {us:.1f} us ({roof / us:.0%}), x{tile / us:.2f} vs tiles, "
                  f"{same:.1%} of outputs equal to the tile path's")
        w13 = w2 = None  # free before the next shape
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
