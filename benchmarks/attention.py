"""Paged attention on the GPU: the Triton kernel that reads K/V in place through the block tables against the
engine's CUDA path before it (K/V gathered through the block tables into contiguous copies, then torch SDPA);
FlashInfer / flash-attn are reported as importable or absent.

Qwen3-30B-A3B's attention shape (H=32 query heads, Hkv=4, d=128, bf16), block size 16, pages of every sequence
scattered over the cache. Cases:
  decode   B sequences of one new token over L keys (B x L: 1x2048, 1x8192, 16x2048, 64x1024, 64x4096)
  prefill  B prompts of L tokens, nothing cached (1x1024, 16x1024)
  extend   B chunks of 512 tokens after a cached prefix of 1536 (4x512)
Times are CUDA-graph replays (median of 50, device events: no host launch overhead); where a path cannot be
captured both are timed eagerly (back-to-back calls between events) and the row says so. Roofline per case:
max(bytes / HBM rate, flops / bf16 GEMM rate), bytes = K/V read once + q and out, flops = 4 * d * H * (visible
query-key pairs); both rates measured on this GPU at the start (device_rates.py).

    python benchmarks/attention.py [--out X.json]     # GPU, ~1 min
Writes JSON (device named) to --out, else $OUT/attention_<device>.json, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from device_rates import measure_rates  # noqa: E402
from e2e_generate import write_result  # noqa: E402
from moe_infer.kernels.fused_moe_bench import graph_time_us  # noqa: E402
from moe_infer.layers.paged_attention import paged_attention_sdpa  # noqa: E402

H, HKV, D, PAGE = 32, 4, 128, 16
CASES = [("decode", 1, 2048, 0), ("decode", 1, 8192, 0), ("decode", 16, 2048, 0), ("decode", 64, 1024, 0),
         ("decode", 64, 4096, 0), ("prefill", 1, 1024, 0), ("prefill", 16, 1024, 0), ("extend", 4, 512, 1536)]


def build(kind: str, B: int, L: int, cached: int, gen: torch.Generator):
    """Random cache + metadata: (args of paged_attention_*, bytes, flops)."""
    q_len = 1 if kind == "decode" else L
    ctx = L if kind == "decode" else cached + L  # keys after this step
    blocks_per_seq = -(-ctx // PAGE)
    Nb = B * blocks_per_seq
    perm = torch.randperm(Nb, generator=gen)
    tables = perm.view(B, blocks_per_seq).to(torch.int32).cuda()
    k_cache = torch.randn(Nb, PAGE, HKV, D, generator=gen).to(torch.bfloat16).cuda()
    v_cache = torch.randn(Nb, PAGE, HKV, D, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(B * q_len, H, D, generator=gen).to(torch.bfloat16).cuda()
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, B * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    positions = (torch.arange(q_len) + ctx - q_len).repeat(B).cuda()
    args = (q, k_cache, v_cache, tables, seq_lens, starts, positions, D ** -0.5, q_len, ctx)
    elem = 2
    nbytes = 2 * B * ctx * HKV * D * elem + 2 * q.numel() * elem
    pairs = B * sum(ctx - q_len + i + 1 for i in range(q_len)) if q_len > 1 else B * ctx
    return args, nbytes, 4 * D * H * pairs


def eager_time_us(fn, iters: int = 20) -> float:
    """Mean of `iters` back-to-back calls between two device events (host launch overhead included)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def graph_or_none(fn):
    """The CUDA-graph median, or None where the path cannot be captured (recorded as such)."""
    try:
        return graph_time_us(fn, 50)  # the median of 50 replays, each between device events
    except Exception as err:  # noqa: BLE001 - e.g. a host sync inside the path
        print(f"  (not capturable: {type(err).__name__}: {str(err).splitlines()[0][:100]})")
        torch.cuda.synchronize()
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from moe_infer.kernels.paged_attention import paged_attention_triton

    gen = torch.Generator().manual_seed(0)
    device = torch.cuda.get_device_name()
    rates = measure_rates("cuda")
    hbm_bytes_s, bf16_flops = rates["hbm_gbps"] * 1e9, rates["tflops"] * 1e12
    rows = []
    for kind, B, L, cached in CASES:
        a, nbytes, flops = build(kind, B, L, cached, gen)
        ref = paged_attention_sdpa(*a).float()
        out = paged_attention_triton(*a).float()
        err = float((out - ref).abs().max())
        ours_eager = eager_time_us(lambda: paged_attention_triton(*a))
        sdpa_eager = eager_time_us(lambda: paged_attention_sdpa(*a))
        ours_graph = graph_or_none(lambda: paged_attention_triton(*a))
        sdpa_graph = graph_or_none(lambda: paged_attention_sdpa(*a))
        t_ours = ours_graph if ours_graph is not None else ours_eager
        t_sdpa = sdpa_graph if sdpa_graph is not None and ours_graph is not None else sdpa_eager
        if sdpa_graph is None or ours_graph is None:
            t_ours = ours_eager  # compare like with like: both eager
        roof = max(nbytes / hbm_bytes_s, flops / bf16_flops) * 1e6
        rows.append(dict(kind=kind, batch=B, tokens=L, cached=cached, ours_us=t_ours, sdpa_gather_us=t_sdpa,
                         timing="graph" if sdpa_graph is not None and ours_graph is not None else "eager",
                         ours_graph_us=ours_graph, ours_eager_us=ours_eager, sdpa_graph_us=sdpa_graph,
                         sdpa_eager_us=sdpa_eager, roofline_us=roof, ours_pct_roofline=100 * roof / t_ours,
                         speedup_vs_sdpa=t_sdpa / t_ours, max_abs_diff_vs_sdpa=err))
        del a
        torch.cuda.empty_cache()
    print(f"paged attention, {device}, H={H} Hkv={HKV} d={D} bf16, block {PAGE}; CUDA-graph medians (us); roofline at "
          f"{rates['hbm_gbps']:.0f} GB/s, {rates['tflops']:.0f} TFLOP/s (measured)")
    print(f"{'case':>8} {'B':>3} {'L':>5} {'cached':>6} {'timing':>6} {'ours':>8} {'sdpa+gather':>11} "
          f"{'roofline':>8} {'%roof':>6} {'x sdpa':>7} {'max|diff|':>9}")
    for r in rows:
        print(f"{r['kind']:>8} {r['batch']:>3} {r['tokens']:>5} {r['cached']:>6} {r['timing']:>6} {r['ours_us']:>8.1f} "
              f"{r['sdpa_gather_us']:>11.1f} {r['roofline_us']:>8.1f} {r['ours_pct_roofline']:>6.1f} "
              f"{r['speedup_vs_sdpa']:>7.2f} {r['max_abs_diff_vs_sdpa']:>9.4f}")
    result = dict(device=device, torch=torch.__version__, commit=os.environ.get("GIT_COMMIT"),
                  shape=dict(H=H, Hkv=HKV, d=D, block_size=PAGE, dtype="bfloat16"), rows=rows,
                  roofline=dict(hbm_bytes_per_s=hbm_bytes_s, bf16_flops=bf16_flops, measured=rates))
    write_result(result, f"attention_{device.replace(' ', '_').lower()}.json", args.out)


if __name__ == "__main__":
    main()
