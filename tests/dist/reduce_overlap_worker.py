"""torchrun worker (2 ranks): the reduce dispatcher's overlapped MoE layer equals the same layer unsplit.

    torchrun --nproc-per-node 2 tests/dist/reduce_overlap_worker.py

The mesh is tp = ep = 2 on 2 ranks: one stage of 2 ranks, every rank holding the same tokens. Every rank builds
a one-rank reference layer (all experts, seeded weights) and from it two EP layers with the reduce dispatcher
and its experts: one with overlap off (unsplit: one stage all-reduce), one with overlap on. Cases: M = 2, 3
micro-batches x no shared expert / a shared expert merged into the stage all-reduce (split over tp, which spans
the stage) / a shared expert apart (whole on every rank, added after the all-reduce) x the torch experts / the
fused reference (the dispatcher's no-regroup path). Checked, per case and rank:
  - a step at the payload threshold (`overlap_min_mb`): the output equals the unsplit layer's (TOL), which
    equals the one-rank reference (TOL); exactly M stage all-reduces, all asynchronous; the load statistics
    count the step's T*K routed rows once;
  - a step under the threshold, and a step while a CUDA graph would be captured (simulated): one blocking
    stage all-reduce, the unsplit output.
Prints `REDUCE OVERLAP OK <cases>` on rank 0 and exits 0 only if every case passed on every rank.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from moe_infer.config import ParallelConfig, RoutingConfig  # noqa: E402
from moe_infer.experts.reference import EXPERT_BACKENDS, experts_torch  # noqa: E402
from moe_infer.kernels.fused_moe_ref import fused_experts_ref  # noqa: E402
from moe_infer.layers.moe import MoEBackends, MoELayer  # noqa: E402
from moe_infer.layers.tensor_parallel import SINGLE, ShardGroup  # noqa: E402
from moe_infer.parallel import init, reduce_dispatch  # noqa: E402
from moe_infer.routing.spec import RoutingSpec  # noqa: E402
from moe_infer.routing.stats import ExpertLoadStats  # noqa: E402

E, K, D, F_, FS = 8, 2, 32, 24, 16  # FS: the shared expert's intermediate size
TOL = 1e-5  # max abs error / max abs value (float32; the GEMMs of a chunk block rows differently)
MIN_MB = 0.004  # the threshold: T = 40 tokens of 32 float32 values (5.1 kB) reach it, T = 21 (2.7 kB) does not
T_OVER, T_UNDER = 40, 21


def experts_torch_fused(x_RD, meta, w13_E2FD, w2_EDF):
    """The torch experts, declaring the fused reference: the dispatcher's no-regroup path on gloo."""
    return experts_torch(x_RD, meta, w13_E2FD, w2_EDF)


experts_torch_fused.fused_experts = fused_experts_ref
EXPERT_BACKENDS.register("torch_fused")(experts_torch_fused)


@dataclass(frozen=True)
class CountingShardGroup(ShardGroup):
    """The stage axis, recording each all-reduce the layer issues ("sync" / "async")."""

    calls: list = field(default_factory=list, compare=False)

    def all_reduce(self, x):
        self.calls.append("sync")
        return super().all_reduce(x)

    def all_reduce_async(self, x):
        self.calls.append("async")
        return super().all_reduce_async(x)


def build_reference(shared: str, experts: str) -> MoELayer:
    torch.manual_seed(1234)  # the same weights on every rank
    layer = MoELayer(0, D, F_, RoutingSpec(num_experts=E, top_k=K), MoEBackends(experts=experts), torch.float32,
                     shared_intermediate_size=FS if shared != "none" else 0, shared_gated=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return layer


def build_ep_layer(ref, ctx, shared: str, experts: str, overlap: bool, micro_batches: int):
    """The EP layer holding this rank's experts (and its tp slice of a merged shared expert) of `ref`."""
    ctx.cfg = dataclasses.replace(ctx.base_cfg, dispatcher="reduce", overlap=overlap, overlap_min_mb=MIN_MB,
                                  overlap_micro_batches=micro_batches)
    disp = ctx.make_dispatcher(E, K, RoutingConfig(), tokens_replicated=True)
    axis = ctx.stage_axis()
    stage = CountingShardGroup(axis.group, axis.rank, axis.size, on_error=axis.on_error, always=axis.always)
    tp = ctx.model_shard(1).tp if shared == "merged" else SINGLE
    stats = ExpertLoadStats(1, E, "cpu")
    layer = MoELayer(0, D, F_, ref.spec, MoEBackends(experts=experts, dispatcher=disp, stats=stats), torch.float32,
                     shared_intermediate_size=FS if shared != "none" else 0, shared_gated=True, tp=tp, stage=stage)
    with torch.no_grad():
        layer.gate.weight.copy_(ref.gate.weight)
        ids = torch.tensor(disp.local_expert_ids)
        layer.store.w13_E2FD.copy_(ref.store.w13_E2FD[ids])
        layer.store.w2_EDF.copy_(ref.store.w2_EDF[ids])
        if shared != "none":
            src, dst = ref.shared_expert, layer.shared_expert
            rows = slice(tp.rank * FS // tp.size, (tp.rank + 1) * FS // tp.size)
            gate_FD, up_FD = src.gate_up_proj.weight.chunk(2)
            dst.gate_up_proj.weight.copy_(torch.cat([gate_FD[rows], up_FD[rows]]))
            dst.down_proj.weight.copy_(src.down_proj.weight[:, rows])
            dst.gate.weight.copy_(src.gate.weight)
    return layer, stage, stats


def rel_err(a, b) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)


def run(layer, stage, x_TD):
    stage.calls.clear()
    with torch.no_grad():
        out_TD = layer(x_TD)
    return out_TD, list(stage.calls)


def check_case(ctx, case) -> list:
    M, shared, experts = case
    ref = build_reference(shared, experts)
    plain, plain_stage, _ = build_ep_layer(ref, ctx, shared, experts, overlap=False, micro_batches=M)
    split, split_stage, stats = build_ep_layer(ref, ctx, shared, experts, overlap=True, micro_batches=M)
    problems = []
    for T in (T_OVER, T_UNDER):
        x_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(99 + T))  # the same on every rank
        with torch.no_grad():
            ref_TD = ref(x_TD)
        plain_TD, plain_calls = run(plain, plain_stage, x_TD)
        if plain_calls != ["sync"] or not rel_err(plain_TD, ref_TD) <= TOL:
            problems.append(f"T={T}: unsplit layer: {plain_calls}, rel err {rel_err(plain_TD, ref_TD):.1e} to one rank")
        stats.reset()
        split_TD, split_calls = run(split, split_stage, x_TD)
        want = ["async"] * M if T == T_OVER else ["sync"]
        if split_calls != want:
            problems.append(f"T={T}: stage all-reduces {split_calls}, expected {want}")
        if not rel_err(split_TD, plain_TD) <= TOL:
            problems.append(f"T={T}: overlapped layer differs from the unsplit one: rel err {rel_err(split_TD, plain_TD):.1e}")
        if int(stats.routed_LE.sum()) != T * K:
            problems.append(f"T={T}: {int(stats.routed_LE.sum())} routed rows counted, expected {T * K}")
    capturing = reduce_dispatch._graph_capturing
    reduce_dispatch._graph_capturing = lambda: True  # a CUDA graph being captured: decode graphs keep one all-reduce
    try:
        x_TD = torch.randn(T_OVER, D, generator=torch.Generator().manual_seed(7))
        captured_TD, calls = run(split, split_stage, x_TD)
    finally:
        reduce_dispatch._graph_capturing = capturing
    plain_TD, _ = run(plain, plain_stage, x_TD)
    if calls != ["sync"] or not torch.equal(captured_TD, plain_TD):
        problems.append(f"under capture: stage all-reduces {calls} (expected one), equal to unsplit: "
                        f"{torch.equal(captured_TD, plain_TD)}")
    return problems


def main() -> int:
    world = int(os.environ["WORLD_SIZE"])
    ctx = init(ParallelConfig(tp=world, ep=world, timeout_s=120), device="cpu")
    ctx.base_cfg = ctx.cfg
    assert ctx.stage_axis().size == world and ctx.model_shard(1).tp.size == world
    cases = list(itertools.product((2, 3), ("none", "merged", "apart"), ("torch", "torch_fused")))
    failures = []
    for case in cases:
        failures += [f"rank {ctx.rank} {case}: {p}" for p in check_case(ctx, case)]
    all_failures: list = [None] * world
    dist.all_gather_object(all_failures, failures)
    if ctx.rank == 0:
        flat = [f for fs in all_failures for f in fs]
        for f in flat:
            print("FAIL", f)
        if not flat:
            print(f"REDUCE OVERLAP OK {len(cases)}")
    ok = not any(all_failures)
    ctx.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
