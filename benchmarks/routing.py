"""Routing benchmark: Triton gating + permutation vs the PyTorch composition, CUDA-graph timing.

For T in {1, 32, 256, 2048, 8192} and (E, K) in {(8, 2), (64, 8), (128, 8), (256, 8 grouped)}:
  triton      route_rows_triton: gate + tile counts in one launch, tile scan, scatter (sorted rows, inverse map,
              block-padded layout), launched with PDL, group counts in the kept-zero buffer (no memset);
              triton_two_step: select_experts_triton + permute_rows_triton (PDL off and a memset per call were
              measured slower: docs/notes/routing.md)
  torch_ref   select_experts_torch (stable sort) + permute_rows_torch: the same outputs, bit for bit
  torch_topk  softmax/sigmoid + torch.topk (+ grouped masking) + permute_rows_torch: the usual composition
Speedup is against the faster of the two PyTorch compositions. Also timed: the drop policy (capacity_factor 1.25,
by position) on top of both pipelines. Each time is the median of triton.testing.do_bench_cudagraph (several calls
captured in one graph; inputs stay in L2). Results and history: docs/notes/routing.md.
Usage: python benchmarks/routing.py [--out DIR] [--quick]. Prints a table, writes routing_<device>.json.
The kernels' registers, spills and SASS size at these shapes (no GPU needed): scripts/routing_sass.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_generate import write_result  # noqa: E402
from moe_infer.routing.capacity import CAPACITY_POLICIES  # noqa: E402
from moe_infer.routing.permute import permute_rows_torch  # noqa: E402
from moe_infer.routing.select import select_experts_torch  # noqa: E402
from moe_infer.routing.spec import RoutingSpec  # noqa: E402
from moe_infer.routing.triton_permute import permute_rows_triton  # noqa: E402
from moe_infer.routing.triton_route import route_rows_triton  # noqa: E402
from moe_infer.routing.triton_select import select_experts_triton  # noqa: E402

TOKENS = (1, 32, 256, 2048, 8192)
MODELS = {  # name: spec
    "E8_K2_softmax": RoutingSpec(8, 2),  # Mixtral
    "E64_K8_softmax": RoutingSpec(64, 8, renormalize=False),  # OLMoE
    "E128_K8_softmax": RoutingSpec(128, 8),  # Qwen3-MoE
    "E256_K8_grouped": RoutingSpec(256, 8, scoring="sigmoid", num_expert_group=8, topk_group=4,
                                   routed_scaling_factor=2.5, has_score_bias=True),  # DeepSeek-V3
}
BLOCK_SIZE = 64
TARGET_SPEEDUP, TARGET_US_8192_E256 = 4.0, 25.0


def select_topk_torch(logits_TE, spec, bias_E):
    """The usual PyTorch router: scores, (grouped mask,) torch.topk, gather, renormalise."""
    T, E = logits_TE.shape
    x = logits_TE.float()
    scores_TE = torch.softmax(x, -1) if spec.scoring == "softmax" else torch.sigmoid(x)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    if spec.num_expert_group > 1:
        G = spec.num_expert_group
        group_TG = choice_TE.view(T, G, E // G).topk(2, -1)[0].sum(-1)
        gidx = group_TG.topk(spec.topk_group, -1)[1]
        mask_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, gidx, True)
        choice_TE = choice_TE.masked_fill(~mask_TG.repeat_interleave(E // G, 1), float("-inf"))
    ids_TK = choice_TE.topk(spec.top_k, -1)[1]
    w_TK = scores_TE.gather(1, ids_TK)
    if spec.renormalize:
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    return w_TK * spec.routed_scaling_factor, ids_TK.int()


def pipelines(spec, x_TE, bias_E):
    E = spec.num_experts
    drop = CAPACITY_POLICIES.get("drop")
    kw = dict(logits_TE=x_TE, spec=spec, capacity_factor=1.25, min_capacity=4)

    def triton_route():  # fused: gate + tile histogram, tile scan, scatter (three launches)
        return route_rows_triton(x_TE, spec, bias_E, BLOCK_SIZE)[2]

    def triton_two_step():  # gate, then the stand-alone permutation (four launches)
        w, ids = select_experts_triton(x_TE, spec, bias_E)
        return permute_rows_triton(ids, w, E, 0, BLOCK_SIZE)

    def ref_route():
        w, ids = select_experts_torch(x_TE, spec, bias_E)
        return permute_rows_torch(ids, w, E, 0, BLOCK_SIZE)

    def topk_route():
        w, ids = select_topk_torch(x_TE, spec, bias_E)
        return permute_rows_torch(ids, w, E, 0, BLOCK_SIZE)

    def triton_drop():
        w, ids = select_experts_triton(x_TE, spec, bias_E)
        ids, w = drop(ids, w, backend="triton", **kw)
        return permute_rows_triton(ids, w, E, 0, BLOCK_SIZE)

    def torch_drop():
        w, ids = select_topk_torch(x_TE, spec, bias_E)
        ids, w = drop(ids, w, backend="torch", **kw)
        return permute_rows_torch(ids, w, E, 0, BLOCK_SIZE)

    return dict(triton=triton_route, triton_two_step=triton_two_step, torch_ref=ref_route, torch_topk=topk_route,
                triton_gate=lambda: select_experts_triton(x_TE, spec, bias_E),
                triton_drop=triton_drop, torch_drop=torch_drop)


def check_equal(fns, name="triton"):
    a, b = fns[name](), fns["torch_ref"]()
    for f in ("order_R", "inv_N", "token_idx_R", "counts_E", "offsets_E1"):
        if not torch.equal(getattr(a, f), getattr(b, f)):
            raise AssertionError(f"triton and torch_ref differ in {f}")
    if not torch.allclose(a.weights_R, b.weights_R, atol=2e-6, rtol=1e-5):
        raise AssertionError("triton and torch_ref weights differ")
    for f in ("sorted_rows_P", "block_expert_B", "padded_offsets_E1", "num_padded"):
        if not torch.equal(getattr(a.layout, f), getattr(b.layout, f)):
            raise AssertionError(f"triton and torch_ref differ in layout.{f}")



def check_drop_equal(spec, x_TE, bias_E):
    w, ids = select_experts_triton(x_TE, spec, bias_E)
    kw = dict(logits_TE=x_TE, spec=spec, capacity_factor=1.25, min_capacity=4)
    a = CAPACITY_POLICIES.get("drop")(ids, w, backend="triton", **kw)
    b = CAPACITY_POLICIES.get("drop")(ids, w, backend="torch", **kw)
    if not (torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1], atol=1e-6, rtol=1e-5)):
        raise AssertionError("the Triton and PyTorch drop policies differ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="a folder (default: $OUT, else benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="two token counts only")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    rows = []
    for name, spec in MODELS.items():
        for T in TOKENS[1::3] if args.quick else TOKENS:
            gen = torch.Generator(device="cuda").manual_seed(T)
            x_TE = torch.randn(T, spec.num_experts, device="cuda", generator=gen).to(torch.bfloat16)
            bias_E = torch.randn(spec.num_experts, device="cuda", generator=gen) * 0.05 if spec.has_score_bias else None
            fns = pipelines(spec, x_TE, bias_E)
            try:
                check_equal(fns)
                check_equal(fns, "triton_two_step")
                check_drop_equal(spec, x_TE, bias_E)
                error = None
            except AssertionError as err:  # keep timing, but the row says it is wrong
                error = str(err)
                print(f"MISMATCH {name} T={T}: {error}", flush=True)
            us = {k: 1000 * do_bench_cudagraph(fn, rep=30, return_mode="median") for k, fn in fns.items()}
            base = min(us["torch_ref"], us["torch_topk"])
            rows.append(dict(model=name, T=T, E=spec.num_experts, K=spec.top_k, **{f"{k}_us": v for k, v in us.items()},
                             outputs_equal=error is None, error=error,
                             speedup=base / us["triton"], drop_speedup=us["torch_drop"] / us["triton_drop"]))
            r = rows[-1]
            print(f"{name:16s} T={T:5d} triton {r['triton_us']:7.1f}us  two-step {r['triton_two_step_us']:7.1f}  "
                  f"gate {r['triton_gate_us']:6.1f}  "
                  f"ref {r['torch_ref_us']:7.1f}  topk {r['torch_topk_us']:7.1f}  x{r['speedup']:.1f}  "
                  f"drop {r['triton_drop_us']:6.1f} vs {r['torch_drop_us']:6.1f}", flush=True)
    big = [r for r in rows if r["T"] == 8192 and r["E"] == 256]
    summary = dict(
        all_outputs_equal=all(r["outputs_equal"] for r in rows),
        min_speedup=min(r["speedup"] for r in rows),
        all_speedups_ge_4x=all(r["speedup"] >= TARGET_SPEEDUP for r in rows),
        t8192_e256_us=big[0]["triton_us"] if big else None,
        t8192_e256_under_25us=bool(big) and big[0]["triton_us"] < TARGET_US_8192_E256,
    )
    result = dict(device=dev, torch=torch.__version__, triton=triton.__version__, commit=os.environ.get("GIT_COMMIT"),
                  block_size=BLOCK_SIZE,
                  timing="triton.testing.do_bench_cudagraph median, bf16 logits", rows=rows, summary=summary)
    name = f"routing_{re.sub(r'[^a-z0-9]+', '_', dev.lower()).strip('_')}.json"
    path = write_result(result, name, os.path.join(args.out, name) if args.out else None)
    print(f"\n{'model':16s} {'T':>5s} {'triton us':>9s} {'torch us':>9s} {'speedup':>7s}")
    for r in rows:
        print(f"{r['model']:16s} {r['T']:5d} {r['triton_us']:9.1f} {min(r['torch_ref_us'], r['torch_topk_us']):9.1f} "
              f"{r['speedup']:7.1f}")
    print(json.dumps(summary), "->", path)


if __name__ == "__main__":
    main()
