"""Trial (measurement notes, not a benchmark): the decode-shaped linear layers, cuBLAS against the
skinny GEMM kernel over its tiles and K splits.

Each point is a CUDA graph of REPS pairs [RMSNorm -> linear] (distinct weights, more bytes than L2
holds, as in a decode step) minus a graph of the REPS norms alone: the linear's time as the engine
sees it, its launch gap included. Shapes: the dense projections and router of Qwen3-30B-A3B,
Mixtral-8x7B and OLMoE (bf16).

    python benchmarks/trials/skinny_gemm_sweep.py [--rows 1,2,3,4] [--quick]
"""
import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from attention import graph_time_us  # noqa: E402  (benchmarks/: a CUDA graph's median replay time)

SHAPES = [  # name, N, K
    ("qwen3 qkv", 5120, 2048), ("qwen3 o", 2048, 4096), ("qwen3 router", 128, 2048),
    ("mixtral qkv", 6144, 4096), ("mixtral o", 4096, 4096), ("mixtral router", 8, 4096),
    ("olmoe qkv", 6144, 2048), ("olmoe o", 2048, 2048), ("olmoe router", 64, 2048),
]
REPS = 24
HBM = 3.0e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--quick", action="store_true", help="fewer configs")
    args = ap.parse_args()
    from moe_infer.kernels.rms_norm import rms_norm_triton
    from moe_infer.kernels.skinny_gemm import SkinnyConfig, _num_sms, skinny_config, skinny_gemm

    dev = torch.device("cuda")
    sms = _num_sms(dev)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; us per linear (graph of {REPS} norm+linear pairs minus "
          f"{REPS} norms); roofline = weight bytes / {HBM / 1e12:.1f} TB/s")
    grid = dict(block_n=(2, 4, 8), block_k=(512, 1024, 2048, 4096), warps=(4, 8))
    if args.quick:
        grid = dict(block_n=(4, 8), block_k=(1024, 2048, 4096), warps=(4,))
    t0 = time.time()
    summary = []
    for name, N, K in SHAPES:
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(REPS)]
        nw = torch.ones(K, device=dev, dtype=torch.bfloat16)
        roof = N * K * 2 / HBM * 1e6
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = F.linear(rms_norm_triton(x, nw, 1e-6), ws[0]).float()
            norms = graph_time_us(lambda: [rms_norm_triton(x, nw, 1e-6) for _ in range(REPS)]) / REPS

            def pair(lin):
                def fn():
                    for w in ws:
                        lin(rms_norm_triton(x, nw, 1e-6), w)
                return fn
            cublas = graph_time_us(pair(lambda h, w: F.linear(h, w))) / REPS - norms
            results = []
            for bn, bk, wp in itertools.product(grid["block_n"], grid["block_k"], grid["warps"]):
                if bk > 2 * triton.next_power_of_2(K):
                    continue
                cfg = SkinnyConfig(bn, bk, num_warps=wp)
                try:
                    y = skinny_gemm(rms_norm_triton(x, nw, 1e-6), ws[0], config=cfg).float()
                except OutOfResources:
                    continue
                bad = float((y - ref).abs().max()) > 2e-2 * float(ref.abs().max()) + 1e-2
                us = graph_time_us(pair(lambda h, w, c=cfg: skinny_gemm(h, w, config=c))) / REPS - norms
                results.append((us, cfg, bad))
            results.sort(key=lambda r: r[0])
            rule = skinny_config(M, N, K, sms)
            rule_us = graph_time_us(pair(lambda h, w: skinny_gemm(h, w))) / REPS - norms
            os.environ["MOE_SKINNY_PDL"] = "0"
            nopdl_us = graph_time_us(pair(lambda h, w: skinny_gemm(h, w))) / REPS - norms
            os.environ["MOE_SKINNY_PDL"] = "1"
            best = results[0]
            top = "  ".join(f"{c.block_n}x{c.block_k}/w{c.num_warps}:{u:.2f}{'!' if b else ''}"
                            for u, c, b in results[:4])
            print(f"{name:15s} M {M:2d}  roof {roof:5.2f}  cublas {cublas:6.2f}  rule {rule_us:6.2f} "
                  f"({rule.block_n}x{rule.block_k}; no PDL {nopdl_us:6.2f})  best {top}",
                  flush=True)
            summary.append((name, M, roof, cublas, rule_us, best[0]))
            if any(b for _, _, b in results):
                print("   ! some configs disagree with cuBLAS beyond 2e-2 relative")
        ws = None
        torch.cuda.empty_cache()
    print(f"sweep took {time.time() - t0:.0f} s")
    print("name, M, roofline, cuBLAS, rule, best (us); the rule against cuBLAS:")
    for name, M, roof, cub, rule, best in summary:
        print(f"{name:15s} {M:2d} {roof:6.2f} {cub:6.2f} {rule:6.2f} {best:6.2f}  {cub / rule:5.2f}x")


if __name__ == "__main__":
    main()
