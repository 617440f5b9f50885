"""Trial (measurement notes, not a benchmark): decode paged attention against its split-KV count.

For decode steps of B sequences over L cached keys (Qwen3-30B-A3B heads: H=32, Hkv=4, d=128, bf16, block
16), the CUDA-graph time of `paged_attention_triton` with every power-of-two split count that leaves at
least 64 keys a split (merge launch included), next to the count the wrapper picks (`auto`).

    python benchmarks/trials/attention_splits.py [--batches 1,4,16,64] [--lengths 256,1024,2048,8192,32768]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from attention import build, graph_time_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--lengths", default="256,1024,2048,8192,32768")
    ap.add_argument("--max-splits", type=int, default=128)
    args = ap.parse_args()
    from moe_infer.kernels.paged_attention import _num_sms, num_splits, paged_attention_triton
    from moe_infer.layers.paged_attention import paged_attention_sdpa

    gen = torch.Generator().manual_seed(0)
    sms = _num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; decode, H=32 Hkv=4 d=128 bf16; CUDA-graph medians (us)")
    for B in [int(b) for b in args.batches.split(",")]:
        for L in [int(n) for n in args.lengths.split(",")]:
            if B * L > 64 * 8192:
                continue
            a, nbytes, _ = build("decode", B, L, 0, gen)
            ref = paged_attention_sdpa(*a).float()
            auto = num_splits(B * 4, L, 1, sms)
            cells = []
            s = 1
            while s <= args.max_splits and (s == 1 or L // s >= 64):
                out = paged_attention_triton(*a, splits=s).float()
                err = float((out - ref).abs().max())
                t = graph_time_us(lambda: paged_attention_triton(*a, splits=s))
                cells.append(f"{s}:{t:.1f}{'*' if s == auto else ''}{'!' if err > 2e-2 else ''}")
                s *= 2
            roof = nbytes / 3.0e12 * 1e6
            print(f"B {B:3d} L {L:6d} roof {roof:7.1f}  " + "  ".join(cells), flush=True)
            torch.cuda.empty_cache()
    print("(splits:us; * the current choice; ! error vs SDPA above 2e-2)")


if __name__ == "__main__":
    main()
