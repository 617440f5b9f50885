"""Offline sm_90 build of one Triton kernel (no GPU needed): registers, spills, SASS size and the
instruction mix that tells the fast paths apart (HGMMA = wgmma, LDGSTS = cp.async, UTMALDG = TMA,
REDUX, LDG before the first FADD...).

    python scripts/sass_report.py moe_infer.kernels.fused_moe_gemm:gate_up_kernel --warps 8 --stages 4 \
        --const BLOCK_M=128 BLOCK_N=128 BLOCK_K=64 GROUP_M=8 IS_FP32_DOT=0 USE_TMA=0 DOT_PRECISION=tf32 \
                INLINE=0 N_PAD=16 E_PAD=16 USE_PDL=1 stride_wk=1 \
        --types x_ptr=*bf16 w13_ptr=*bf16 act_ptr=*bf16 sorted_ptr=*i32 expert_ptr=*i32 num_padded_ptr=*i32 \
        --div16 D F stride_xm stride_we stride_wn stride_am

At run time Triton specialises every pointer and every integer argument divisible by 16 (and integers
equal to 1) and vectorises / pipelines on that; give the same facts here (--div16, `name=1` in --const)
or the build is not the one the GPU runs (e.g. 2-byte loads and spills instead of cp.async). Pointers
default to *i64 and integers to i32 unless --types names them. For the GPU machine's Triton (3.6) run
this under that version (a venv with `pip install triton==3.6.0` works on a CPU machine) with
PTXAS=ptxas; Triton 3.9's PTX needs its ptxas-blackwell (the default where it exists).
`scripts/routing_sass.py` builds the routing kernels through this module.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

OPS = ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDSM", "LDG", "STG", "REDUX", "SHFL", "BAR", "MUFU")


def _value(text: str):
    if text.lstrip("-").isdigit():
        return int(text)
    return {"True": True, "False": False}.get(text, text)


def build(fn, consts: dict, types: dict, div16, num_warps: int, num_stages: int) -> tuple:
    """(ptxas -v output, SASS text) of fn built for sm_90(a)."""
    sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "*i64" if p.name.endswith("_ptr") else "i32")
           for p in fn.params}
    for name, v in consts.items():  # constexpr parameters take the value; others are specialised to it
        if sig.get(name) != "constexpr" and isinstance(v, int) and v == 1:
            sig[name] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if sig[p.name] != "constexpr" and (p.name.endswith("_ptr") or p.name in div16)}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    default = "ptxas-blackwell" if os.path.exists(os.path.join(bindir, "ptxas-blackwell")) else "ptxas"
    ptxas = os.path.join(bindir, os.environ.get("PTXAS", default))
    arch = "sm_90a" if ".target sm_90a" in k.asm["ptx"] else "sm_90"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        info = subprocess.run([ptxas, f"-arch={arch}", "-v", ptx, "-o", cubin], capture_output=True, text=True)
        if info.returncode:
            raise RuntimeError(info.stderr)
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    return info.stderr, sass


def report(info: str, sass: str) -> dict:
    ops = collections.Counter()
    seq = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(2)] += 1
            seq.append(m.group(2))
    first_fadd = next((i for i, op in enumerate(seq) if op == "FADD"), len(seq))
    regs = re.findall(r"Used (\d+) registers", info)
    spills = re.findall(r"(\d+) bytes spill stores", info)
    return dict(sass=len(seq), registers=int(regs[0]) if regs else None, spill_bytes=int(spills[0]) if spills else None,
                ldg_before_first_fadd=seq[:first_fadd].count("LDG"), **{op: ops.get(op, 0) for op in OPS})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", help="module:function, e.g. moe_infer.kernels.ep_rows:combine_rows_kernel")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--const", nargs="*", default=[], help="NAME=VALUE (constexprs, or integer args specialised)")
    ap.add_argument("--types", nargs="*", default=[], help="NAME=TYPE (*bf16, *fp32, *i32, fp32, i64, ...)")
    ap.add_argument("--div16", nargs="*", default=[], help="integer arguments divisible by 16 at run time")
    args = ap.parse_args()
    module, name = args.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    consts = {k: _value(v) for k, v in (c.split("=", 1) for c in args.const)}
    types = dict(t.split("=", 1) for t in args.types)
    info, sass = build(fn, consts, types, set(args.div16), args.warps, args.stages)
    print(f"{name} (triton {triton.__version__}, sm_90):", report(info, sass))


if __name__ == "__main__":
    main()
