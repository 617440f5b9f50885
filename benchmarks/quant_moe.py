"""Fused MoE experts per weight format: bf16, fp8 (128 x 128 blocks, W8A8), int4 (group 128, W4A16), mxfp4 (W4A16),
per model shape and token count (decode and prefill), against the roofline of the format's bytes.

  us          the fused experts call (schedule, both GEMMs, combine), CUDA-graph replay, median (GPU); wall clock of
              one call under the Triton interpreter (--tiny, CPU: a smoke run, not a speed figure)
  roofline    max(bytes of the distinct experts touched in the format (weights + scales) / HBM rate,
              2*T*K*3*D*F / bf16 GEMM rate); both rates measured on this GPU at the start (benchmarks/device_rates.py)
  rel_err     the output against the bf16 fused experts on the format's weights dequantized (at the first token count)

    python benchmarks/quant_moe.py [--shapes ...] [--tokens ...] [--formats ...] [--out PATH]   # one GPU
    TRITON_INTERPRET=1 python benchmarks/quant_moe.py --tiny --out /tmp/q.json                 # CPU

Writes JSON (device named) to --out, else $OUT/quant_moe_<device>.json, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from moe_infer.kernels.fused_moe_bench import (  # noqa: E402
    MODEL_SHAPES, graph_time_us, make_inputs, replays_for,
)
from moe_infer.kernels.fused_moe_config import device_name  # noqa: E402
from moe_infer.kernels.w4_format import dequantize_int4, dequantize_mxfp4  # noqa: E402
from moe_infer.quant import BlockFp8, quantize_block_fp8  # noqa: E402
from device_rates import measure_rates  # noqa: E402
from e2e_generate import write_result  # noqa: E402

FORMATS = ("bf16", "fp8", "int4", "mxfp4")
TOKENS = (1, 16, 64, 512, 2048)
TINY_SHAPE = {"tiny": (4, 2, 64, 32)}  # E, K, D, F
TINY_TOKENS = (1, 5)


def make_format(fmt: str, E: int, D: int, F: int, block: int, device: str, seed: int = 0):
    """(w13, w2, extra) of E experts in the format, built one expert at a time (no [E, 2F, D] float32 temporary);
    weights ~ N(0, 1 / fan_in)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for N, K in ((2 * F, D), (D, F)):
        parts = []
        for _ in range(E):
            w = torch.randn(N, K, generator=gen, device=device) * K ** -0.5
            if fmt == "bf16":
                parts.append((w.to(torch.bfloat16),))
            elif fmt == "fp8":
                parts.append(quantize_block_fp8(w, block, block))
            elif fmt == "int4":
                from moe_infer.kernels.w4_format import quantize_int4

                parts.append(quantize_int4(w, block, True, torch.bfloat16)[:2])
            else:
                from moe_infer.kernels.w4_format import quantize_mxfp4

                parts.append(quantize_mxfp4(w))
            del w
        out.append(tuple(torch.stack([p[i] for p in parts]) for i in range(len(parts[0]))))
    return out


def format_bytes_per_weight(fmt: str, block: int) -> float:
    return {"bf16": 2.0, "fp8": 1.0 + 4.0 / (block * block), "int4": 0.5 + 2.0 / block, "mxfp4": 0.5 + 1.0 / 32}[fmt]


def runner(fmt: str, w13, w2, block: int, x, ids, wts):
    from moe_infer.kernels.fused_moe import fused_experts

    if fmt == "bf16":
        return lambda: fused_experts(x, ids, wts, w13[0], w2[0])
    if fmt == "fp8":
        from moe_infer.kernels.fused_moe_fp8 import fused_moe_fp8

        return lambda: fused_moe_fp8(x, ids, wts, w13[0], w13[1], w2[0], w2[1], block, block)
    from moe_infer.kernels.fused_moe_w4a16 import fused_moe_int4, fused_moe_mxfp4

    if fmt == "int4":
        return lambda: fused_moe_int4(x, ids, wts, w13[0], w13[1], w2[0], w2[1], block)
    return lambda: fused_moe_mxfp4(x, ids, wts, w13[0], w13[1], w2[0], w2[1])


def dequantized(fmt: str, w, block: int) -> torch.Tensor:
    """The format's weights in bf16, one expert at a time (no float32 copy of all experts)."""
    if fmt == "bf16":
        return w[0]
    out = torch.empty(*w[0].shape[:2], w[1].shape[2] * (32 if fmt == "mxfp4" else block), dtype=torch.bfloat16,
                      device=w[0].device)
    for e in range(out.shape[0]):
        if fmt == "fp8":
            out[e] = BlockFp8(w[1][e], block, block).dequantize(w[0][e], torch.bfloat16)
        elif fmt == "int4":
            out[e] = dequantize_int4(w[0][e], w[1][e], None, block, torch.bfloat16)
        else:
            out[e] = dequantize_mxfp4(w[0][e], w[1][e], torch.bfloat16)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (TRITON_INTERPRET=1): a smoke run")
    parser.add_argument("--shapes", nargs="*", default=None, help=f"of {list(MODEL_SHAPES)}")
    parser.add_argument("--tokens", nargs="*", type=int, default=None)
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--tiny runs the Triton kernels under the interpreter: set TRITON_INTERPRET=1")
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny (and TRITON_INTERPRET=1) on the CPU")
    shapes = TINY_SHAPE if args.tiny else {s: MODEL_SHAPES[s] for s in (args.shapes or MODEL_SHAPES)}
    tokens = args.tokens or (TINY_TOKENS if args.tiny else TOKENS)
    block = 32 if args.tiny else 128
    rates = measure_rates(device)
    hbm, flops = rates["hbm_gbps"] * 1e9, rates["tflops"] * 1e12
    print(f"{device_name()}: roofline rates (measured): HBM copy {hbm / 1e12:.2f} TB/s (read + write), "
          f"bf16 GEMM {flops / 1e12:.0f} TFLOP/s")
    rows = []
    for shape, (E, K, D, F) in shapes.items():
        ref_w = None
        for fmt in args.formats:
            w13, w2 = make_format(fmt, E, D, F, block, device)
            for i, T in enumerate(tokens):
                x, ids, wts = make_inputs(T, E, K, D, device=device, seed=T)
                fn = runner(fmt, w13, w2, block, x, ids, wts)
                if i == 0:
                    ref_w = (dequantized(fmt, w13, block), dequantized(fmt, w2, block))
                    from moe_infer.kernels.fused_moe import fused_experts

                    ref = fused_experts(x, ids, wts, *ref_w).float()
                    rel_err = ((fn().float() - ref).norm() / ref.norm()).item()
                    del ref_w
                if device == "cuda":
                    us = graph_time_us(fn, replays_for(100.0))
                else:
                    t0 = time.perf_counter()
                    fn()
                    us = (time.perf_counter() - t0) * 1e6
                num_distinct = int(torch.unique(ids[ids >= 0]).numel())
                t_mem = num_distinct * 3 * D * F * format_bytes_per_weight(fmt, block) / hbm
                t_flop = 2 * ids.numel() * 3 * D * F / flops
                roof = max(t_mem, t_flop) * 1e6
                rows.append(dict(shape=shape, format=fmt, tokens=T, us=round(us, 2), roofline_us=round(roof, 2),
                                 of_roofline=round(roof / us, 3), rel_err=round(rel_err, 5)))
                print(f"{shape:>14} {fmt:>5} T={T:<5} {us:10.1f} us  roofline {roof:9.1f} us  "
                      f"{roof / us:6.1%}  rel_err {rel_err:.2e}")
            del w13, w2
            if device == "cuda":
                torch.cuda.empty_cache()
    result = dict(device=device_name(), hbm_bytes_per_s=hbm, bf16_flops=flops, rates=rates, block=block, rows=rows,
                  note="fp8: W8A8 with 128x128 weight blocks; int4: group 128 symmetric; mxfp4: OCP e2m1 + e8m0 / 32")
    write_result(result, f"quant_moe_{device_name()}.json", args.out)


if __name__ == "__main__":
    main()
