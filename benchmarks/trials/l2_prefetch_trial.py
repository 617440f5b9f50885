"""Trial (measurement notes, not a benchmark): does prefetching the attention output projection's weight into
L2 during a decode layer's latency-bound kernels make that projection faster?

A CUDA graph of LAYERS pseudo-layers at batch 1 (Qwen3-30B-A3B's shapes, distinct weights per layer):
RMSNorm -> qkv (skinny GEMM, 21 MB) -> a spin kernel standing in for RoPE + attention (SPIN_US, little
memory traffic) -> o_proj (skinny GEMM, 16.8 MB) -> a 75 MB read standing in for the experts. Variants:
  none      as is
  prefetch  at the layer's start a side stream issues an L2 prefetch of o_proj's weight
  hot       o_proj reads one weight in every layer (an upper bound: L2-resident)
The o_proj alone is timed too (graph of its LAYERS calls), and each variant's o_proj share is read
as (variant - variant without o_proj).

The prefetch kernel (here, not in the package: it was not kept) issues sm_90 bulk prefetches
(`cp.async.bulk.prefetch.L2`, one per 4 KB) and exits; nothing waits on the copies.

    python benchmarks/trials/l2_prefetch_trial.py [--spin-us 11]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from attention import graph_time_us  # noqa: E402  (benchmarks/: a CUDA graph's median replay time)

LAYERS = 8
CHUNK = 4096  # bytes per bulk prefetch instruction (a multiple of 16)
LANES = 128  # prefetches issued by one program


@triton.jit
def l2_prefetch_kernel(ptr, num_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(num_bytes - offs, CHUNK).to(tl.int32)
    size = tl.where(size > 0, size, 0)
    # a zero-sized prefetch is not issued: the asm's predicate skips lanes past the end
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor) -> None:
    """Issue bulk L2 prefetches over t's bytes (contiguous, CUDA sm_90+); returns at once, nothing waits on them."""
    num_bytes = t.numel() * t.element_size() // 16 * 16  # sizes are multiples of 16
    l2_prefetch_kernel[(triton.cdiv(num_bytes, CHUNK * LANES),)](t, num_bytes, CHUNK=CHUNK, LANES=LANES, num_warps=4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin-us", type=float, default=11.0)
    args = ap.parse_args()
    from moe_infer.kernels.rms_norm import rms_norm_triton
    from moe_infer.kernels.skinny_gemm import skinny_gemm

    dev = torch.device("cuda")
    D, QKV, O_IN = 2048, 5120, 4096
    bf = torch.bfloat16
    wqkv = [torch.randn(QKV, D, device=dev, dtype=bf) * 0.02 for _ in range(LAYERS)]
    wo = [torch.randn(D, O_IN, device=dev, dtype=bf) * 0.02 for _ in range(LAYERS)]
    experts = [torch.randn(75 * 2 ** 20 // 2, device=dev, dtype=bf) for _ in range(2)]
    sink = torch.zeros(1, device=dev)
    x = torch.randn(1, D, device=dev, dtype=bf)
    a = torch.randn(1, O_IN, device=dev, dtype=bf)
    nw = torch.ones(D, device=dev, dtype=bf)
    clock_hz = torch.cuda.get_device_properties(dev).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1.98e9
    cycles = int(args.spin_us * 1e-6 * clock_hz)
    side = torch.cuda.Stream()

    def layers(prefetch=False, hot=False, with_o=True):
        def fn():
            main = torch.cuda.current_stream()
            for layer in range(LAYERS):
                h = rms_norm_triton(x, nw, 1e-6)
                w = wo[0] if hot else wo[layer]
                if prefetch:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        l2_prefetch(w)
                skinny_gemm(h, wqkv[layer])
                torch.cuda._sleep(cycles)
                if with_o:
                    skinny_gemm(a, w)
                sink.add_(experts[layer % 2].sum(dtype=torch.float32))  # the experts' bytes
            if prefetch:
                main.wait_stream(side)
        return fn

    print(f"{torch.cuda.get_device_name()}; us per layer (graph of {LAYERS}); spin {args.spin_us} us = {cycles} cycles; "
          f"o_proj bytes {D * O_IN * 2 / 2**20:.1f} MiB = {D * O_IN * 2 / 3.0e12 * 1e6:.1f} us at 3.0 TB/s")
    o_alone = graph_time_us(lambda: [skinny_gemm(a, w) for w in wo]) / LAYERS
    o_alone_hot = graph_time_us(lambda: [skinny_gemm(a, wo[0]) for _ in wo]) / LAYERS
    print(f"o_proj alone: {o_alone:.2f} us from HBM, {o_alone_hot:.2f} us from L2 (one weight repeated)")
    for _ in range(2):
        for name, kw in (("none", {}), ("prefetch", dict(prefetch=True)), ("hot", dict(hot=True))):
            full = graph_time_us(layers(**kw)) / LAYERS
            without = graph_time_us(layers(**kw, with_o=False)) / LAYERS
            print(f"{name:9s} layer {full:7.2f} us, without o_proj {without:7.2f} us, o_proj's share {full - without:6.2f} us")


if __name__ == "__main__":
    main()
