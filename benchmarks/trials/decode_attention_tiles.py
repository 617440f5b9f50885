"""Trial (measurement notes, not a benchmark): the one-kernel decode attention (`rope_decode_attention`) against
its key tile (BLOCK_N), split count and warps, at short and middle contexts.

Qwen3-30B-A3B heads (H=32, Hkv=4, d=128, bf16, block 16, per-head q/k norm). For each batch B and context L
(L - 1 cached keys and the new token), every BLOCK_N in --tiles, every power-of-two split count that leaves a
split at least one tile of keys, and 4 or 8 warps: the time per call of a CUDA graph of --chain calls in a row
(under PDL each call's head overlaps the one before, as in a decode step's graph) and the max difference to the
current choice's output. The current choice (`num_splits`, `decode_block_n`, 4 warps) is marked '*'.

    python benchmarks/trials/decode_attention_tiles.py [--batches 1,4,16] [--lengths 128,256,512,1024,2048]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from attention import graph_time_us  # noqa: E402  (benchmarks/)

H, HKV, D, S = 32, 4, 128, 16
DEV = "cuda"


def case(B, L, gen):
    dev = DEV
    blocks = -(-L // S)
    Nb = B * blocks + 1
    tables = torch.randperm(Nb - 1, generator=gen)[: B * blocks].view(B, blocks).to(torch.int32).to(dev)
    k_cache = torch.randn(Nb, S, HKV, D, generator=gen).to(torch.bfloat16).to(dev)
    v_cache = torch.randn(Nb, S, HKV, D, generator=gen).to(torch.bfloat16).to(dev)
    qkv = torch.randn(B, (H + 2 * HKV) * D, generator=gen).to(torch.bfloat16).to(dev)
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    pos = L - 1
    slots = (tables[:, pos // S].long() * S + pos % S)
    cos_sin = torch.randn(L + 8, D, generator=gen).to(torch.bfloat16).to(dev)
    w = (1 + torch.randn(2, D, generator=gen) / 8).to(torch.bfloat16).to(dev)
    return dict(q=q.view(B, H, D), k=k.view(B, HKV, D), v=v.view(B, HKV, D),
                positions=torch.full((B,), pos, device=dev), cos_sin=cos_sin, k_cache=k_cache, v_cache=v_cache,
                slots=slots, tables=tables, seq_lens=torch.full((B,), L, dtype=torch.int32, device=dev),
                query_start=torch.arange(B + 1, dtype=torch.int32, device=dev), max_seq_len=L,
                norm_kw=dict(q_norm_weight=w[0].contiguous(), k_norm_weight=w[1].contiguous(), norm_eps=1e-6,
                             norm_mode="head"))


def call(c, **kw):
    from moe_infer.kernels.rope_decode_attention import rope_decode_attention
    return rope_decode_attention(
        c["q"], c["k"], c["v"], c["positions"], c["cos_sin"], c["k_cache"], c["v_cache"], c["slots"], c["tables"],
        c["seq_lens"], c["query_start"], D ** -0.5, c["max_seq_len"], None, **c["norm_kw"], **kw)


def per_call_us(fn, chain: int) -> float:
    """Median graph time of `chain` calls in a row (benchmarks/attention.py's timing), per call."""
    def chained():
        for _ in range(chain):
            fn()
    return graph_time_us(chained) / chain


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--lengths", default="128,256,512,1024,2048")
    ap.add_argument("--tiles", default="32,64,128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--json", default="", help="write every timing here")
    args = ap.parse_args()
    from moe_infer.kernels.paged_attention import _num_sms, decode_block_n, num_splits

    gen = torch.Generator().manual_seed(0)
    sms = _num_sms(torch.device("cuda"))
    rows = []
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; rope_decode_attention, H={H} Hkv={HKV} d={D} bf16, "
          f"us per call in a graph of {args.chain} calls (median of 50 replays)", flush=True)
    for B in [int(b) for b in args.batches.split(",")]:
        for L in [int(n) for n in args.lengths.split(",")]:
            c = case(B, L, gen)
            auto = num_splits(B * HKV, L, 1, sms)
            auto_bn = decode_block_n(B * HKV, L, auto, sms, D * 2)
            ref = call(c).float()
            cells = []
            for bn in [int(t) for t in args.tiles.split(",")]:
                for w in [int(x) for x in args.warps.split(",")]:
                    s = 1
                    while s == 1 or L // s >= bn:
                        out = call(c, splits=s, block_n=bn, num_warps=w).float()
                        err = float((out - ref).abs().max())
                        t = per_call_us(lambda: call(c, splits=s, block_n=bn, num_warps=w), args.chain)
                        mark = "*" if (bn, s, w) == (auto_bn, auto, 4) else ""
                        cells.append((t, f"n{bn}/s{s}/w{w}:{t:.1f}{mark}{'!' if err > 3e-2 else ''}"))
                        rows.append(dict(B=B, L=L, block_n=bn, splits=s, warps=w, us=t, err=err, current=bool(mark)))
                        s *= 2
            best = min(cells)[0]
            cur = [t for t, label in cells if "*" in label]
            print(f"B {B:3d} L {L:5d} current {cur[0] if cur else float('nan'):.1f} best {best:.1f}: "
                  + "  ".join(label for _, label in sorted(cells)[:8]), flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, chain=args.chain, rows=rows), f)
    print("(tile/splits/warps:us, the 8 fastest; * the current choice; ! max diff to the current choice > 3e-2)")


if __name__ == "__main__":
    main()
