"""Trial (measurement notes): the gate_up kernels of two trees compiled offline for sm_90, their PTX compared.

No GPU is needed: Triton compiles for a target (here sm_90, Hopper) on any machine that has its CUDA backend.
For the per-tile kernel (`gate_up_kernel`: pointer and TMA weights) and the persistent one (TMA and pointer), at
decode and prefill tile shapes, the kernels of --old-dir (fused_moe_gemm.py and fused_moe_persistent.py of an older
tree, loaded as gate_up_body_ab.py does) and of this tree are compiled with the same signature, the same divisibility
hints and the same constants. Their PTX is compared with labels, comments, debug sections and register numbers
removed: "same" means the same instructions in the same order; otherwise the number of differing lines and the
change in each opcode's count are printed.

    mkdir -p DIR && for f in fused_moe_gemm fused_moe_persistent; do
        git show de9b1b5:moe_infer/kernels/$f.py > DIR/$f.py; done      # the old files
    python benchmarks/trials/gate_up_ptx_compare.py --old-dir DIR      # CPU: about a minute

Outcome against de9b1b5 (benchmarks/results/trials/gate_up_ptx_compare_triton*_cpu.log): with Triton 3.6, the lent
GPUs' version, every case compiles to the same PTX; with Triton 3.9 (this machine's) the per-tile kernels are the
same and the persistent ones differ in the order of 9-12 prologue instructions (the same instructions).
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import triton  # noqa: E402
from gate_up_body_ab import load_old  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import moe_infer.kernels.fused_moe_gemm as gemm  # noqa: E402
import moe_infer.kernels.fused_moe_persistent as persistent  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PER_TILE_ARGS = ["x_ptr", "w13_ptr", "act_ptr", "sorted_ptr", "expert_ptr", "num_padded_ptr", "num_rows", "ROW_DIV",
                 "D", "F", "num_tiles_m", "expert_start", "E", "stride_xm", "stride_we", "stride_wn", "stride_wk",
                 "stride_am"]
PERSISTENT_ARGS = ["x_ptr", "w13_ptr", "act_ptr", "sorted_ptr", "expert_ptr", "num_padded_ptr", "num_rows", "ROW_DIV",
                   "D", "F", "stride_xm", "stride_we", "stride_wn", "stride_wk", "stride_am"]
DIVISIBLE = {"x_ptr", "w13_ptr", "act_ptr", "sorted_ptr", "expert_ptr", "num_padded_ptr", "D", "F", "stride_xm",
             "stride_we", "stride_wn", "stride_am"}  # what the engine's launches specialize as multiples of 16


def signature(names, w13_type, constants):
    sig = {n: ("*i32" if n.endswith("ptr") and n not in ("x_ptr", "w13_ptr", "act_ptr") else
               "*bf16" if n.endswith("ptr") else "i32") for n in names}
    sig["w13_ptr"] = w13_type
    sig.update({k: "constexpr" for k in constants})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in DIVISIBLE and not (n == "w13_ptr" and w13_type != "*bf16")}
    return sig, attrs


def ptx_lines(fn, names, w13_type, constants, num_warps, num_stages):
    sig, attrs = signature(names, w13_type, constants)
    src = ASTSource(fn, signature=sig, constexprs=constants, attrs=attrs)
    ptx = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}).asm["ptx"]
    ptx = re.sub(r"\.section\s+\.debug[\s\S]*", "", re.sub(r"//.*|\.loc.*|\.file.*", "", ptx))
    ptx = re.sub(r"\$L__\w+", "L", re.sub(r"%[a-z]+[0-9]+", "%R", re.sub(r"gate_up_\w*kernel\w*", "K", ptx)))
    return [line.strip() for line in ptx.splitlines() if line.strip() and not line.strip().startswith("L")]


def cases(old_tile, old_persistent):
    for bm, bn, bk, warps, stages in ((16, 32, 256, 4, 4), (16, 64, 128, 4, 4), (64, 64, 128, 4, 3),
                                      (128, 128, 64, 8, 4), (128, 128, 64, 8, 3)):
        for tma in (False, True):
            w13 = f"tensordesc<bf16[{bn}, {bk}]>" if tma else "*bf16"
            common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1 if bm <= 16 else 8, IS_FP32_DOT=False,
                          USE_TMA=tma, DOT_PRECISION="tf32", USE_PDL=True, ONE_DOT=False)
            yield ("per-tile", tma, bm, bn, bk, warps, stages, old_tile, gemm.gate_up_kernel, PER_TILE_ARGS,
                   w13, dict(common, INLINE=False, N_PAD=16, E_PAD=16))
            if bm >= 64:
                yield ("persistent", tma, bm, bn, bk, warps, stages, old_persistent,
                       persistent.gate_up_persistent_kernel, PERSISTENT_ARGS, w13,
                       dict(common, NUM_PROGRAMS=132, FLATTEN=True, GATHERED=False))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-dir", required=True)
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, target sm_{TARGET.arch}")
    for kind, tma, bm, bn, bk, warps, stages, old, new, names, w13, consts in cases(*load_old(args.old_dir)):
        a = ptx_lines(old, names, w13, consts, warps, stages)
        b = ptx_lines(new, names, w13, consts, warps, stages)
        ops_a, ops_b = Counter(x.split()[0] for x in a), Counter(x.split()[0] for x in b)
        delta = {k: ops_b[k] - ops_a[k] for k in sorted(set(ops_a) | set(ops_b)) if ops_b[k] != ops_a[k]}
        differ = sum(1 for x, y in itertools.zip_longest(a, b) if x != y)
        verdict = "same" if a == b else f"{differ} of {len(a)} / {len(b)} lines differ, opcode counts new - old {delta}"
        print(f"{kind:10s} {'tma' if tma else 'ptr'} {bm}x{bn}x{bk} w{warps} s{stages}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
