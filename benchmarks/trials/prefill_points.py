"""The loop the fused-MoE prefill trials share: their arguments, each shape's weights made once, one row per
(shape, token count) from the trial's `bench_point`, the JSON written after every row (a cut-short run keeps
what it measured) under benchmarks/results/trials/<stem>_<device>.json unless --out says where.

    parser = prefill_parser(__doc__)        --shapes, --tokens (default: the issue's 2048,8192), --out
    run_points(parser.parse_args(), stem, bench_point, weights=make_weights)
        bench_point(name, T, *weights(E, D, F)) -> dict
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Callable, Tuple

import torch
import triton

from moe_infer.kernels.fused_moe_bench import MODEL_SHAPES, make_weights
from moe_infer.kernels.fused_moe_config import device_name


def prefill_parser(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(MODEL_SHAPES))
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--out", default=None)
    return parser


def run_points(args: argparse.Namespace, stem: str, bench_point: Callable[..., dict],
               weights: Callable[[int, int, int], Tuple[torch.Tensor, ...]] = make_weights) -> None:
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "trials",
                                   f"{stem}_{device_name()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    rows = []
    for name in args.shapes.split(","):
        E, _, D, F = MODEL_SHAPES[name]
        tensors = weights(E, D, F)
        for T in map(int, args.tokens.split(",")):
            rows.append(bench_point(name, T, *tensors))
            with open(out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                           "timing": "CUDA-graph replay, median, bf16", "points": rows}, f, indent=1)
        del tensors
        torch.cuda.empty_cache()
    print(f"wrote {out}")
