"""Trial (measurement notes): are the kernels slower now that their per-step sizes are not specialized?

Every kernel of moe_infer.kernels with a `do_not_specialize` list is timed against its twin re-jitted from the
same source with Triton's default specialization (what ran before), in one process, on the same inputs:
the fused MoE path (schedule, gate_up, down, combine), the routing gate + permutation (the schedule of large
steps), paged attention (decode with and without split-KV, prefill) and rope_kv. Token counts divisible by
16 and T = 1 are where the default specialization knew the most. Each case is a CUDA-graph replay median,
taken three times per variant, interleaved; the minimum of the three is reported.

    python benchmarks/trials/specialize_ab.py [--out DIR]     # H100: ~2 min (both variants compile)
Writes specialize_ab_<device>.json to --out, else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from moe_infer.kernels import jit_kernels  # noqa: E402
from moe_infer.kernels.fused_moe_bench import graph_time_us, make_inputs, make_weights  # noqa: E402
from moe_infer.kernels.fused_moe_config import device_name  # noqa: E402


_TWINS: dict = {}  # id(kernel with do_not_specialize) -> the same source jitted with the default specialization


@contextlib.contextmanager
def default_specialization():
    """Inside: every module attribute holding a kernel with `do_not_specialize` holds its default twin."""
    if not _TWINS:
        _TWINS.update({id(k): triton.jit(k.fn) for k in jit_kernels() if getattr(k, "do_not_specialize", None)})
    twins, swapped = _TWINS, []
    for module in [m for name, m in sys.modules.items() if name.startswith("moe_infer.") and m is not None]:
        for name, obj in list(vars(module).items()):
            if id(obj) in twins:
                swapped.append((module, name, obj))
                setattr(module, name, twins[id(obj)])
    try:
        yield len(twins)
    finally:
        for module, name, obj in swapped:
            setattr(module, name, obj)


def moe_cases():
    from moe_infer.kernels.fused_moe import fused_experts

    for shape, (E, K, D, F), tokens in (("qwen3-30b-a3b", (128, 8, 2048, 768), (1, 16, 64, 512, 2048, 4096)),
                                         ("mixtral-8x7b", (8, 2, 4096, 14336), (1, 64, 2048))):
        w13, w2 = make_weights(E, D, F)
        for T in tokens:
            x, ids, w = make_inputs(T, E, K, D)
            yield f"fused_experts {shape}", T, (lambda x=x, ids=ids, w=w, w13=w13, w2=w2: fused_experts(x, ids, w, w13, w2))


def routing_cases():
    from moe_infer.routing.spec import RoutingSpec
    from moe_infer.routing.triton_permute import permute_rows_triton
    from moe_infer.routing.triton_select import select_experts_triton

    spec = RoutingSpec(num_experts=128, top_k=8)
    for T in (1, 64, 4096):
        logits = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)

        def gate_and_permute(logits=logits):
            w, ids = select_experts_triton(logits, spec)
            return permute_rows_triton(ids, w, 128, 0, 64)
        yield "gate + permute E=128 K=8", T, gate_and_permute


def attention_cases():
    sys.path.insert(0, os.path.join(HERE, ".."))
    from attention import build

    from moe_infer.kernels.paged_attention import paged_attention_triton
    from moe_infer.kernels.rope_kv import rope_store_kv

    gen = torch.Generator().manual_seed(0)
    for kind, B, L in (("decode", 1, 8192), ("decode", 16, 2048), ("decode", 64, 2048), ("prefill", 1, 1024)):
        args = build(kind, B, L, 0, gen)[0]
        yield f"paged attention {kind} B={B} L={L}", args[0].shape[0], (lambda a=args: paged_attention_triton(*a))
    H, Hkv, d, page = 32, 4, 128, 16
    k_cache = torch.zeros(1024, page, Hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    cos_sin = torch.randn(8192, d, device="cuda", dtype=torch.bfloat16)
    for T in (1, 64, 4096):
        qkv = torch.randn(T, (H + 2 * Hkv) * d, device="cuda", dtype=torch.bfloat16)
        q, k, v = (t.view(T, -1, d) for t in qkv.split([H * d, Hkv * d, Hkv * d], dim=-1))
        pos, slots = torch.arange(T, device="cuda"), torch.arange(T, device="cuda")
        yield "rope_store_kv Qwen3-30B heads", T, (lambda q=q, k=k, v=v, pos=pos, slots=slots: rope_store_kv(
            q, k, v, pos, cos_sin, k_cache, v_cache, slots))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "..", "results")))
    args = ap.parse_args()
    rows = []
    print(f"{'case':42s} {'T':>5s} {'default us':>11s} {'no-spec us':>11s} {'ratio':>6s}")
    for case, T, fn in [c for cases in (moe_cases, routing_cases, attention_cases) for c in cases()]:
        times = {"default": [], "no_spec": []}
        for _ in range(3):
            with default_specialization():
                times["default"].append(graph_time_us(fn, num_replays=50))
            times["no_spec"].append(graph_time_us(fn, num_replays=50))
        a, b = min(times["default"]), min(times["no_spec"])
        rows.append(dict(case=case, tokens=T, default_us=a, no_specialize_us=b, ratio=b / a))
        print(f"{case:42s} {T:5d} {a:11.1f} {b:11.1f} {b / a:6.3f}", flush=True)
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"worst ratio (no-specialize / default): {worst['ratio']:.3f} ({worst['case']}, T={worst['tokens']}); "
          f"geomean {torch.tensor([r['ratio'] for r in rows]).log().mean().exp():.3f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"specialize_ab_{device_name()}.json")
    with open(path, "w") as f:
        json.dump(dict(device=device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
