"""Trial (measurement notes): the gate_up GEMM's two-dot K loop, shared by the per-tile and the persistent kernel.

Until de9b1b5 the per-tile kernel (`gate_up_kernel`) and the persistent one (`gate_up_persistent_kernel`) each had
their own copy of the two-dot K loop; the per-tile copy carried its row and weight pointers from one K step to the
next, the persistent copy computed them from k. 8efeb1d made both call one helper, `gate_up_two_dot`
(fused_moe_gemm.py), computing them from k. Offline PTX for sm_90: the persistent kernels were the same
instructions; the per-tile ones differed in their address arithmetic. This times the whole fused path with the
kernels of the old files (--old-dir: fused_moe_gemm.py and fused_moe_persistent.py as they were at de9b1b5) against
the current ones, on the points of benchmarks/fused_moe.py with their tuned configs, in one process: both variants
--reps times, interleaved with the order alternating, CUDA-graph replay medians, the minimum kept; the two outputs
are compared bit for bit.

Measured on one H200 (benchmarks/results/trials/gate_up_body_ab_run*_nvidia_h200.*): same bits at every point. The
per-tile TMA prefill points read 1.00-1.10x new/old in both runs, the persistent points (the same PTX) 0.96-1.05x.
Those ratios are not the kernels': the first timing of a long compute-bound point, right after the light ones, read
5-10 % faster than every later timing of the same kernel (the GPU's clocks settle under sustained load), and the
minimum kept it, always for the variant timed first. A third run (--persistent-carry at 00041fe, since removed: the
persistent kernel's K loop with carried pointers against computed ones) timed the very same per-tile kernel twice
at the 8192 points and read 1.00-1.06x (`gate_up_persistent_carry_ab_*`); the persistent points read 1.00x there
once that first timing is left out. So no difference between the two ways of addressing was measured. The helper
takes CARRY anyway, so that each kernel compiles to the PTX of its former own copy (gate_up_ptx_compare.py), which
needs no timing. Now every point gets one untimed warm-up timing before the reps.

    mkdir -p DIR && for f in fused_moe_gemm fused_moe_persistent; do
        git show de9b1b5:moe_infer/kernels/$f.py > DIR/$f.py; done      # the old files
    python benchmarks/trials/gate_up_body_ab.py --old-dir DIR [--tokens 512,2048,8192] [--reps 6] [--out DIR]
Writes gate_up_body_ab_<device>.json to --out, else $OUT, else benchmarks/results/trials/ (H200: 40-70 s).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402

import moe_infer.kernels.fused_moe as fm  # noqa: E402
from moe_infer.kernels.fused_moe_bench import (MODEL_SHAPES, TOKEN_COUNTS, graph_time_us, make_inputs,  # noqa: E402
                                               make_weights, roofline_us)
from moe_infer.kernels.fused_moe_config import device_name, get_config  # noqa: E402


def load_old(old_dir: str):
    """(gate_up_kernel, gate_up_persistent_kernel) from the old files; the persistent file's import of the
    per-tile module is pointed at the old one."""
    def load(name: str, path: str, source: str):
        spec = importlib.util.spec_from_loader(name, loader=None, origin=path)
        mod = importlib.util.module_from_spec(spec)
        mod.__file__ = path
        sys.modules[name] = mod
        exec(compile(source, path, "exec"), mod.__dict__)
        return mod

    gemm_path = os.path.join(old_dir, "fused_moe_gemm.py")
    with open(gemm_path) as f:
        gemm = load("old_fused_moe_gemm", gemm_path, f.read())
    pers_path = os.path.join(old_dir, "fused_moe_persistent.py")
    with open(pers_path) as f:
        pers_src = f.read().replace("from moe_infer.kernels.fused_moe_gemm import",
                                              "from old_fused_moe_gemm import")
    pers = load("old_fused_moe_persistent", pers_path, pers_src)
    return gemm.gate_up_kernel, pers.gate_up_persistent_kernel


@contextlib.contextmanager
def kernels(pair):
    saved = fm.gate_up_kernel, fm.gate_up_persistent_kernel
    fm.gate_up_kernel, fm.gate_up_persistent_kernel = pair
    try:
        yield
    finally:
        fm.gate_up_kernel, fm.gate_up_persistent_kernel = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-dir", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "..", "results", "trials")))
    ap.add_argument("--shapes", default=",".join(MODEL_SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)))
    ap.add_argument("--reps", type=int, default=4, help="times each variant is timed (the order alternates)")
    args = ap.parse_args()
    old, new = load_old(args.old_dir), (fm.gate_up_kernel, fm.gate_up_persistent_kernel)
    rows = []
    print(f"{'shape':14s} {'T':>5s} {'persistent':>10s} {'old us':>9s} {'new us':>9s} {'new/old':>7s} same bits")
    for name in args.shapes.split(","):
        E, K, D, F = MODEL_SHAPES[name]
        w13, w2 = make_weights(E, D, F)
        for T in map(int, args.tokens.split(",")):
            x, ids, w = make_inputs(T, E, K, D, seed=T)
            fn = lambda x=x, ids=ids, w=w, w13=w13, w2=w2: fm.fused_experts(x, ids, w, w13, w2)  # noqa: E731
            with kernels(old):
                ref = fn().clone()
            same = bool(torch.equal(ref, fn()))
            graph_time_us(fn, num_replays=30)  # untimed: the first timing after light points reads 5-10 % fast
            times = {"old": [], "new": []}
            for rep in range(args.reps):  # the order alternates: a variant timed second meets a warmer GPU
                for variant in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                    with kernels(old if variant == "old" else new):
                        times[variant].append(graph_time_us(fn, num_replays=30))
            a, b = min(times["old"]), min(times["new"])
            persistent = get_config(T, E, F, D, K, "bf16").gate_up.persistent
            rows.append(dict(shape=name, tokens=T, gate_up_persistent=persistent, old_us=a, new_us=b, ratio=b / a,
                             same_bits=same, roofline_us=roofline_us(ids, E, D, F), old_all=times["old"],
                             new_all=times["new"]))
            print(f"{name:14s} {T:5d} {persistent!s:>10s} {a:9.1f} {b:9.1f} {b / a:7.3f} {same}", flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    ratios = torch.tensor([r["ratio"] for r in rows])
    print(f"geomean new/old {ratios.log().mean().exp():.3f}, worst {ratios.max():.3f}, best {ratios.min():.3f}; "
          f"same bits at {sum(r['same_bits'] for r in rows)}/{len(rows)} points")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gate_up_body_ab_{device_name()}.json")
    with open(path, "w") as f:
        json.dump(dict(device=device_name(), torch=torch.__version__, triton=triton.__version__,
                       git_commit=os.environ.get("GIT_COMMIT"), old="de9b1b5", reps=args.reps, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
