"""Trial (measurement notes, not a benchmark): tile choices of the paged-attention kernel for prefill.

Times `paged_attention_kernel` on a prefill of B x n tokens (Qwen3-30B-A3B heads: 32 query, 4 KV, d=128,
bf16, block size 16, shuffled block tables) at the tile shapes the launch wrapper could choose: query rows
per tile (64 / 128), key tile BLOCK_N, warps, pipeline stages, and the program order (HEAVY_FIRST: the
longest query tiles dispatched first). Each point is checked against the
wrapper's own launch (max abs diff) and timed by CUDA-graph replay (`graph_time_us`: median of 30).

    python benchmarks/trials/attention_prefill_tiles.py [--shapes 1x1024,16x1024,2x1024,1x128] [--sweep]
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from moe_infer.kernels.fused_moe_bench import graph_time_us  # noqa: E402
from moe_infer.kernels.paged_attention import paged_attention_triton  # noqa: E402
from moe_infer.kernels.paged_attention_kernels import paged_attention_kernel  # noqa: E402

H, HKV, D, PAGE = 32, 4, 128, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x1024,16x1024,2x1024,1x128")
    ap.add_argument("--sweep", action="store_true", help="every tile shape, warps and stages (else the wrapper's)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    G = H // HKV
    for shape in args.shapes.split(","):
        B, n = (int(v) for v in shape.split("x"))
        blocks_per_seq = triton.cdiv(n, PAGE)
        Nb = B * blocks_per_seq + 8
        k = torch.randn(Nb, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(B * n, H, D, device=dev, dtype=torch.bfloat16)
        tables = torch.randperm(Nb, device=dev)[:B * blocks_per_seq].view(B, blocks_per_seq).to(torch.int32)
        seq_lens = torch.full((B,), n, dtype=torch.int32, device=dev)
        qsl = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=dev)
        pos = torch.arange(n, device=dev).repeat(B)
        scale = D ** -0.5
        ref = paged_attention_triton(q, k, v, tables, seq_lens, qsl, pos, scale, n, n)
        base = graph_time_us(lambda: paged_attention_triton(q, k, v, tables, seq_lens, qsl, pos, scale, n, n))
        flops = 4 * B * H * D * n * (n + 1) / 2
        print(f"\n=== prefill {B} x {n}: wrapper {base:.1f} us ({flops / base / 1e6:.0f} TFLOP/s)")
        rows_out = []
        space = (itertools.product((False, True), (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)) if args.sweep
                 else [(False, 128, 64, 8, 3), (True, 128, 64, 8, 3)])  # the wrapper's tiles, both orders
        for heavy, rows, block_n, warps, stages in space:
            block_q = rows // G
            out = torch.empty_like(q)

            def run():
                tiles = triton.cdiv(n, block_q)
                paged_attention_kernel[(B * HKV, tiles) if heavy else (B, tiles, HKV)](
                    q, k, v, out, out, out, out, tables, seq_lens, qsl, float(scale), 0,
                    q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                    k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                    tables.stride(0), 0, 0, 0, 0, 0, n,
                    G=G, HKV=HKV, HEAD_D=D, D=D, PAGE=PAGE, BLOCK_Q=block_q, BLOCK_M=rows, BLOCK_N=block_n,
                    NUM_SPLITS=1, HEAVY_FIRST=heavy, HAS_WINDOW=False, DOT_FP32=False, DOT_PRECISION="tf32",
                    num_warps=warps, num_stages=stages)
            try:
                run()
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).abs().max().item()
                us = graph_time_us(run)
            except Exception as e:  # noqa: BLE001 - out of resources etc.: reported, the sweep goes on
                print(f"  heavy_first {heavy} rows {rows} block_n {block_n} warps {warps} stages {stages}: "
                      f"{type(e).__name__}")
                continue
            rows_out.append((us, heavy, rows, block_n, warps, stages, err))
        for us, heavy, rows, block_n, warps, stages, err in sorted(rows_out)[:10]:
            print(f"  {us:7.1f} us ({base / us:.2f}x)  heavy_first {heavy} rows {rows} block_n {block_n} "
                  f"warps {warps} stages {stages}"
                  f"  max|diff| {err:.2e}")


if __name__ == "__main__":
    main()
