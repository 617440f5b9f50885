"""torchrun worker: the EP MoE layer equals the single-rank layer, case by case.

    torchrun --nproc-per-node N tests/dist/ep_layer_worker.py [--device cuda] [--dtypes float32,bfloat16]

Every rank builds the same single-rank layer (all experts, seeded weights) and an EP layer holding
only its slots' experts, feeds both its own tokens and compares. Cases: dispatcher backend x
overlap x replicas (placement file) x replicated tokens x dtype, with the dropless policy (exact)
and the drop / reroute policies (both backends). For non-replicated cases the dispatcher's dropped
rows must be exactly the rows the routing policy dropped. Also checked: the plain dispatch() /
combine() API, three micro-batches, and that ranks disagreeing on micro-batches raise instead of hanging.
The capacity cases run again (first dtype) through the backend's separate steps, which it takes above
`slot_pack_max_rows` routed rows. Prints `EP LAYER OK <cases>` on rank 0 and exits 0 only if every case passed on every rank.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from moe_infer.config import ParallelConfig, RoutingConfig  # noqa: E402
from moe_infer.experts.reference import EXPERT_BACKENDS, experts_torch  # noqa: E402
from moe_infer.kernels.ep_row_ops import SLOT_PACK_MAX_ROWS  # noqa: E402
from moe_infer.kernels.fused_moe_ref import fused_experts_ref  # noqa: E402
from moe_infer.layers.moe import MoEBackends, MoELayer  # noqa: E402
from moe_infer.parallel import init, replicate_hot_experts  # noqa: E402
from moe_infer.parallel.capacity_dispatch import CapacityDispatcher  # noqa: E402
from moe_infer.plugins import load_plugins  # noqa: E402
from moe_infer.routing.spec import RoutingSpec  # noqa: E402

E, K, D, F_ = 8, 2, 32, 24


def experts_torch_fused(x_RD, meta, w13_E2FD, w2_EDF):
    """The torch experts, declaring the fused reference: the EP dispatchers' no-regroup path on gloo."""
    return experts_torch(x_RD, meta, w13_E2FD, w2_EDF)


experts_torch_fused.fused_experts = fused_experts_ref
EXPERT_BACKENDS.register("torch_fused")(experts_torch_fused)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def build_reference(dtype, device, policy, policy_kwargs, experts):
    torch.manual_seed(1234)  # the same weights on every rank
    spec = RoutingSpec(num_experts=E, top_k=K)
    layer = MoELayer(0, D, F_, spec, MoEBackends(policy=policy, policy_kwargs=policy_kwargs, experts=experts), dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return layer.to(device)


def build_ep_layer(ref, ctx, pcfg, policy, policy_kwargs, experts, tokens_replicated):
    routing = RoutingConfig(policy=policy, **{k: v for k, v in policy_kwargs.items() if k != "backend"})
    ctx.cfg = pcfg
    disp = ctx.make_dispatcher(E, K, routing, tokens_replicated=tokens_replicated)
    backends = MoEBackends(policy=policy, policy_kwargs=policy_kwargs, experts=experts, dispatcher=disp)
    layer = MoELayer(0, D, F_, ref.spec, backends, ref.gate.weight.dtype).to(ctx.device)
    with torch.no_grad():
        layer.gate.weight.copy_(ref.gate.weight)
        ids = torch.tensor(disp.local_expert_ids, device=ctx.device)
        layer.store.w13_E2FD.copy_(ref.store.w13_E2FD[ids])
        layer.store.w2_EDF.copy_(ref.store.w2_EDF[ids])
    return layer, disp


def check_case(ctx, case, placement_path):
    backend, overlap, replicas, replicated, dtype_name, policy, ctx.experts = case
    dtype, dev, ep, rank = getattr(torch, dtype_name), ctx.device, ctx.dims.ep, ctx.rank
    policy_kwargs = {} if policy == "dropless" else dict(capacity_factor=1.0, min_capacity=2)
    ref = build_reference(dtype, dev, policy, policy_kwargs, ctx.experts)
    pcfg = dataclasses.replace(ctx.base_cfg, dispatcher=backend, overlap=overlap, overlap_min_mb=0,
                               placement_file=placement_path if replicas else None)
    layer, disp = build_ep_layer(ref, ctx, pcfg, policy, policy_kwargs, ctx.experts, replicated)
    uniform = replicated or backend == "capacity"
    gen = torch.Generator().manual_seed(99 if replicated else 100 + rank)
    T = 21 if uniform else 9 + 5 * rank
    if backend == "exact" and policy == "dropless" and not replicated and rank == ep - 1:
        T = 0  # a rank with nothing to send still serves the others
    x_TD = torch.randn(T, D, generator=gen).to(dev, dtype)
    plans = []
    make_plan = disp._plan
    disp._plan = lambda *args: (plans.append(make_plan(*args)), plans[-1])[1]
    with torch.no_grad():
        out_TD = layer(x_TD)
        ref_TD = ref(x_TD)
        logits_TE = ref.gate(x_TD)
        w_TK, ids_TK = ref._select(logits_TE, ref.spec, None)
        kept_TK, _ = ref._policy(ids_TK, w_TK, logits_TE=logits_TE, spec=ref.spec, **policy_kwargs)
    problems = [] if out_TD.shape == ref_TD.shape else [f"shape {tuple(out_TD.shape)} != {tuple(ref_TD.shape)}"]
    err = 0.0
    if ref_TD.numel():
        err = (out_TD.float() - ref_TD.float()).abs().max().item() / max(ref_TD.float().abs().max().item(), 1e-6)
    if not err <= TOL[dtype]:
        problems.append(f"max rel err {err:.2e}")
    if any(bool(p.overflow_N.any()) for p in plans):
        problems.append("the dispatcher dropped rows the policy kept")
    if not replicated:
        plan = plans[0]
        if not torch.equal(~plan.sent_N, kept_TK.reshape(-1) < 0):
            problems.append("rows the dispatcher did not send differ from the rows the routing policy dropped")
        expected = 2 if overlap and disp.num_local_experts > 1 else 1
        if len(plan.slot_ranges) != expected or len(plans) != 1:
            problems.append(f"expected {expected} micro-batches in one plan, got {len(plan.slot_ranges)} ({len(plans)} plans)")
    return err, problems


def check_plain_api(ctx, backend):
    """dispatch() -> experts -> combine() without forward_experts."""
    policy, kw = ("drop", dict(capacity_factor=1.0, min_capacity=2))
    ref = build_reference(torch.float32, ctx.device, policy, kw, ctx.experts)
    pcfg = dataclasses.replace(ctx.base_cfg, dispatcher=backend, overlap=False)
    layer, disp = build_ep_layer(ref, ctx, pcfg, policy, kw, ctx.experts, False)
    x_TD = torch.randn(16, D, generator=torch.Generator().manual_seed(7 + ctx.rank)).to(ctx.device)
    with torch.no_grad():
        w_TK, ids_TK = ref._select(ref.gate(x_TD), ref.spec, None)
        kept_TK, kw_TK = ref._policy(ids_TK, w_TK, logits_TE=ref.gate(x_TD), spec=ref.spec, **kw)
        x_RD, meta = disp.dispatch(x_TD, kept_TK, kw_TK)
        out_TD = disp.combine(layer._run_experts(x_RD, meta), meta)
        ref_TD = ref(x_TD)
    return [] if torch.allclose(out_TD, ref_TD, atol=1e-5, rtol=1e-5) else ["plain dispatch/combine differs"]


_SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_sync(device):
    """CUDA: torch's sync debug mode set to "error". CPU (a weaker stand-in): the Tensor methods
    that read a value back to Python raise."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(2)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return
    saved = {name: getattr(torch.Tensor, name) for name in _SYNCING}

    def refuse(name):
        def method(*args, **kwargs):
            raise RuntimeError(f"host sync: Tensor.{name}")
        return method

    for name in _SYNCING:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def check_capacity_no_host_sync(ctx):
    """The capacity backend's dispatch and combine, overlap included, never synchronize with the host
    (after a first call of each kind, which builds the dispatcher's tables on the device)."""
    policy, kw = ("drop", dict(capacity_factor=1.0, min_capacity=2))
    ref = build_reference(torch.bfloat16, ctx.device, policy, kw, ctx.experts)
    pcfg = dataclasses.replace(ctx.base_cfg, dispatcher="capacity", overlap=True, overlap_min_mb=0)
    layer, disp = build_ep_layer(ref, ctx, pcfg, policy, kw, ctx.experts, False)
    x_TD = torch.randn(32, D, device=ctx.device, dtype=torch.bfloat16)
    outside = []

    def experts_fn(x_RD, meta):  # the experts backend is not under test here: run it outside the check
        outside.append(True)
        return outside_check(lambda: layer._run_experts(x_RD, meta))

    fused = getattr(layer._experts, "fused_experts", fused_experts_ref)

    def fused_plain(x_RD, ids_R1, w_R1):
        return fused(x_RD, ids_R1, w_R1, *layer.store.weights(), 0)

    def fused_fn(x_RD, ids_R1, w_R1):  # the no-regroup path; its experts run outside the check too
        outside.append(True)
        return outside_check(lambda: fused_plain(x_RD, ids_R1, w_R1))

    with torch.no_grad():
        w_TK, ids_TK = ref._select(ref.gate(x_TD), ref.spec, None)
        kept_TK, kw_TK = ref._policy(ids_TK, w_TK, logits_TE=ref.gate(x_TD), spec=ref.spec, **kw)
        disp.forward_experts(x_TD, kept_TK, kw_TK, layer._run_experts)  # builds the device tables
        x_RD, meta = disp.dispatch(x_TD, kept_TK, kw_TK)  # ... and those of one micro-batch
        disp.combine(layer._run_experts(x_RD, meta), meta)
        disp.forward_experts(x_TD, kept_TK, kw_TK, layer._run_experts, fused_plain)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        state = {}

        def outside_check(fn):
            state["exit"].__exit__(None, None, None)
            try:
                return fn()
            finally:
                state["exit"] = no_host_sync(ctx.device)
                state["exit"].__enter__()

        try:
            state["exit"] = no_host_sync(ctx.device)
            state["exit"].__enter__()
            try:
                disp.forward_experts(x_TD, kept_TK, kw_TK, experts_fn)
                x_RD, meta = disp.dispatch(x_TD, kept_TK, kw_TK)
                disp.combine(experts_fn(x_RD, meta), meta)
                disp.forward_experts(x_TD, kept_TK, kw_TK, experts_fn, fused_fn)
            finally:
                state["exit"].__exit__(None, None, None)
        except RuntimeError as err:
            return [f"host sync: {err}"]
    return [] if len(outside) == 5 else [f"expected 5 expert calls, saw {len(outside)}"]


def check_many_micro_batches(ctx, experts):
    """overlap_micro_batches=3: min(3, S) slot groups, output equal to the single-rank layer."""
    problems = []
    for backend, policy in (("exact", "dropless"), ("capacity", "drop")):
        kw = {} if policy == "dropless" else dict(capacity_factor=1.0, min_capacity=2)
        ref = build_reference(torch.float32, ctx.device, policy, kw, experts)
        pcfg = dataclasses.replace(ctx.base_cfg, dispatcher=backend, overlap=True, overlap_min_mb=0,
                                   overlap_micro_batches=3)
        layer, disp = build_ep_layer(ref, ctx, pcfg, policy, kw, experts, False)
        plans = []
        make_plan = disp._plan
        disp._plan = lambda *args: (plans.append(make_plan(*args)), plans[-1])[1]
        x_TD = torch.randn(19, D, generator=torch.Generator().manual_seed(5 + ctx.rank)).to(ctx.device)
        with torch.no_grad():
            out_TD, ref_TD = layer(x_TD), ref(x_TD)
        if not torch.allclose(out_TD, ref_TD, atol=1e-5, rtol=1e-5):
            problems.append(f"{backend} {experts}: 3 micro-batches differ from one rank")
        if len(plans[0].slot_ranges) != min(3, disp.num_local_experts):
            problems.append(f"{backend}: {len(plans[0].slot_ranges)} micro-batches for {disp.num_local_experts} slots")
    return problems


def check_mismatch_raises(ctx):
    """Rank 0 runs two micro-batches, the others one: every rank must raise, none may hang."""
    ref = build_reference(torch.float32, ctx.device, "dropless", {}, ctx.experts)
    pcfg = dataclasses.replace(ctx.base_cfg, dispatcher="exact", overlap=True, overlap_min_mb=0.004)
    layer, _ = build_ep_layer(ref, ctx, pcfg, "dropless", {}, ctx.experts, False)
    x_TD = torch.randn(20 if ctx.rank == 0 else 8, D, device=ctx.device)
    try:
        with torch.no_grad():
            layer(x_TD)
    except RuntimeError as err:
        return [] if "micro-batch" in str(err) else [f"unexpected error: {err}"]
    return ["ranks with different micro-batch counts did not raise"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--experts", default="torch,torch_fused",
                    help="experts backends, comma-separated (torch, torch_fused: the fused reference, triton)")
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    ctx = init(ParallelConfig(ep=world, timeout_s=120), device=args.device)
    ctx.base_cfg = ctx.cfg
    load_plugins()
    experts = args.experts.split(",")
    for name in experts:
        EXPERT_BACKENDS.get(name)  # fails naming the registered ones
    ctx.experts = experts[0]
    load_E = [1.0 + 10.0 * (e == 3) + 4.0 * (e == 6) for e in range(E)]  # hot experts 3 and 6
    placement = replicate_hot_experts(load_E, world, num_redundant=world)
    path = os.path.join(tempfile.mkdtemp(), "placement.json")
    with open(path, "w") as f:
        f.write(placement.to_json())
    cases = [c for c in itertools.product(("exact", "capacity"), (False, True), (False, True), (False, True),
                                          args.dtypes.split(","), ("dropless", "drop", "reroute"), experts)
             if not (c[0] == "capacity" and c[5] == "dropless")]
    failures, rows = [], []
    for case in cases:
        err, problems = check_case(ctx, case, path)
        rows.append((case, err))
        failures += [f"rank {ctx.rank} {case}: {p}" for p in problems]
    # the capacity backend's separate steps (ranks, slot rows, pack), which it takes above slot_pack_max_rows
    CapacityDispatcher.slot_pack_max_rows = -1
    for case in cases:
        if case[0] == "capacity" and case[4] == args.dtypes.split(",")[0]:
            failures += [f"rank {ctx.rank} separate steps {case}: {p}" for p in check_case(ctx, case, path)[1]]
    CapacityDispatcher.slot_pack_max_rows = SLOT_PACK_MAX_ROWS
    for backend in ("exact", "capacity"):
        failures += [f"rank {ctx.rank} plain {backend}: {p}" for p in check_plain_api(ctx, backend)]
    for name in experts:
        failures += [f"rank {ctx.rank} micro-batches: {p}" for p in check_many_micro_batches(ctx, name)]
    failures += [f"rank {ctx.rank} mismatch: {p}" for p in check_mismatch_raises(ctx)]
    failures += [f"rank {ctx.rank} capacity sync: {p}" for p in check_capacity_no_host_sync(ctx)]
    all_failures: list = [None] * world
    dist.all_gather_object(all_failures, failures)
    if ctx.rank == 0:
        worst = {}
        for case, err in rows:
            worst[case[4]] = max(worst.get(case[4], 0.0), err)
        print(json.dumps({"ranks": world, "device": str(ctx.device), "cases": len(cases), "worst_rel_err": worst}))
        flat = [f for fs in all_failures for f in fs]
        for f in flat:
            print("FAIL", f)
        if not flat:
            print(f"EP LAYER OK {len(cases)}")
    ok = not any(all_failures)
    ctx.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
