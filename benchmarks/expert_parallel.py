"""Expert-parallel MoE layer benchmark: per layer, time of route, dispatch, experts, combine.

    torchrun --nproc-per-node N benchmarks/expert_parallel.py [--models ...] [--tokens ...] --out PATH

For each model shape (Qwen3-30B-A3B, DeepSeek-V3), tokens per rank T and dispatcher backend (`local` at EP=1;
`exact`, `capacity` and `reduce` at EP>1), each rank holds E/ep experts (bf16) and its own T random tokens; the
router is real (gate GEMM + top-k; `capacity` adds the drop policy at capacity factor 1.0). `reduce` is the case of
replicated tokens (attention tensor parallel or replicated): every rank holds the same ep x T tokens, runs its
experts on the rows routed to them and one all-reduce of [ep x T, D] sums the outputs; its `layer` compares with an
all-to-all backend's `layer` + `all_gather`. The experts run as the layer runs them (fused, on the received buffer
as it lies). Timed, each alone:
  route      gate GEMM + top-k (+ drop policy)
  dispatch   plan, send-buffer pack, count exchange (exact), payload all-to-all, received ids
             (capacity: one `slot_pack` launch up to SLOT_PACK_MAX_ROWS routed rows, the separate steps above)
  dispatch_steps  capacity only: the same through the separate steps (ranks, slot rows, pack) at every T
  dispatch_mb2/4  the overlap path's dispatch half: 2 / 4 micro-batches, each packed right before its async
             all-to-all, all received (a variant of `dispatch`; the targets are judged on `dispatch`)
  experts    the fused experts on the received rows (EP=1: the whole fused path on x_TD)
  combine    all-to-all back, top-k sum
  layer      dispatch -> experts -> combine (forward_experts), overlap off / on (2 and 4 micro-batches; `reduce`:
             token chunks, each chunk's all-reduce started under the next one's experts)
  all_gather the ep x T outputs from every rank's T (what an all-to-all costs more with replicated tokens)
  raw_a2a    a bare all_to_all_single of the dispatch payload's bytes (equal splits)
Two timings of each (ep_timing.py): `graph` = CUDA-graph replay, median (not for the exact backend: it syncs with
the host) and `eager` = a loop of eager calls, mean (host launch overhead included). Targets, on graph times:
capacity dispatch and combine each <= 1.15 x raw_a2a; with overlap (the better of 2 and 4 micro-batches), the layer
at 4096 tokens per rank <= 1.15 x max(2 x raw_a2a, experts). JSON names the device.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ep_timing import Timer  # noqa: E402
from ep_report import COLS as STAGES, print_report  # noqa: E402  (the stages, in the report's column order)

from moe_infer.config import ParallelConfig, RoutingConfig  # noqa: E402
from moe_infer.engine.backends import resolve_name  # noqa: E402
from moe_infer.experts.reference import EXPERT_BACKENDS  # noqa: E402
from moe_infer.kernels.ep_row_ops import row_ops  # noqa: E402
from moe_infer.kernels.fused_moe_ref import fused_experts_ref  # noqa: E402
from moe_infer.parallel import init  # noqa: E402
from moe_infer.parallel.all_to_all import weight_columns  # noqa: E402
from moe_infer.plugins import load_plugins  # noqa: E402
from moe_infer.routing.capacity import CAPACITY_POLICIES  # noqa: E402
from moe_infer.routing.select import ROUTING_BACKENDS  # noqa: E402
from moe_infer.routing.spec import RoutingSpec  # noqa: E402

MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v3": (256, 8, 7168, 2048),
          "tiny": (8, 2, 64, 32)}  # E, K, D, F; tiny: a CPU smoke run
OVERLAP = {"layer_overlap": 2, "layer_overlap4": 4}  # micro-batches of each overlap stage


def stage_fns(disp, x_TD, ids_TK, w_TK, fused_fn, ep: int) -> dict:
    """The stages of one layer call as closures over the dispatcher's steps (one micro-batch)."""
    T, D, dev = x_TD.shape[0], x_TD.shape[1], x_TD.device
    if ep == 1:
        return {"experts": lambda: fused_fn(x_TD, ids_TK, w_TK), "layer": lambda: fused_fn(x_TD, ids_TK, w_TK)}
    if getattr(disp, "returns_partial", False):  # reduce: x_TD holds every rank's tokens
        def reduce_experts():
            return disp.forward_experts(x_TD, ids_TK, w_TK, None, fused_fn)

        partial_TD = reduce_experts()

        def reduce_layer():
            out_TD = reduce_experts()
            dist.all_reduce(out_TD, group=disp.group)
            return out_TD

        def reduce_layer_overlap(M):  # M token chunks, as MoELayer._reduce_stage splits a large step
            def run():
                chunks = []
                for x_CD, ids_CK, w_CK in zip(x_TD.tensor_split(M), ids_TK.tensor_split(M), w_TK.tensor_split(M)):
                    out_CD = disp.forward_experts(x_CD, ids_CK, w_CK, None, fused_fn)
                    chunks.append((out_CD, dist.all_reduce(out_CD, group=disp.group, async_op=True)))
                for _, work in chunks:
                    work.wait()
                return torch.cat([out_CD for out_CD, _ in chunks])
            return run
        return {"experts": reduce_experts, "combine": lambda: dist.all_reduce(partial_TD, group=disp.group),
                "layer": reduce_layer, **{stage: reduce_layer_overlap(m) for stage, m in OVERLAP.items()}}

    def dispatch():
        plan = disp._plan(x_TD, ids_TK, w_TK, disp._slot_ranges(1), T)
        recv_XC = disp._received(disp._start_dispatch(plan, x_TD, 0, async_op=False))
        ids_X, weights_X = row_ops(dev).recv_rows(recv_XC, disp._recv_slots(plan, 0), D)
        return plan, recv_XC, ids_X, weights_X

    plan, recv_XC, ids_X, weights_X = dispatch()

    def experts():
        return fused_fn(recv_XC[:, :D], ids_X[:, None], weights_X[:, None])

    y_XD = experts()

    def combine():
        y_back_XD = y_XD.new_empty(plan.num_send_rows, D)
        return disp._finish_combine(plan, [disp._start_combine(plan, 0, y_XD, y_back_XD, False)], y_back_XD)

    def layer():
        return disp.forward_experts(x_TD, ids_TK, w_TK, None, fused_fn)

    def dispatch_steps():  # the capacity backend without its one-launch slot_pack
        disp.slot_pack_max_rows = -1
        try:
            return dispatch()
        finally:
            del disp.slot_pack_max_rows

    def dispatch_mb(num_micro_batches):
        def run():
            mb_plan = disp._plan(x_TD, ids_TK, w_TK, disp._slot_ranges(num_micro_batches), T)
            pending = [disp._start_dispatch(mb_plan, x_TD, m, async_op=True) for m in range(len(mb_plan.slot_ranges))]
            return [row_ops(dev).recv_rows(disp._received(p), disp._recv_slots(mb_plan, m), D)
                    for m, p in enumerate(pending)]
        return run

    out_TD = layer()
    gathered_TD = out_TD.new_empty(ep * T, D)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 / 2.11 name
    fns = {"dispatch": dispatch, "experts": experts, "combine": combine, "layer": layer, "plan": plan,
           "dispatch_mb2": dispatch_mb(2), "dispatch_mb4": dispatch_mb(4),
           "all_gather": lambda: all_gather(gathered_TD, out_TD, group=disp.group)}
    if hasattr(disp, "slot_pack_max_rows"):
        fns["dispatch_steps"] = dispatch_steps
    return fns


def raw_a2a_fn(group, ep: int, rows: int, cols: int, dtype, device):
    """A bare all_to_all_single of rows x cols (equal splits), the same bytes as a payload."""
    rows = max(ep, math.ceil(rows / ep) * ep)
    send = torch.randn(rows, cols, device=device).to(dtype)
    recv = torch.empty_like(send)
    return lambda: dist.all_to_all_single(recv, send, group=group)


def measure(timer, fn, mode: str, errors: list, name: str):
    try:
        return getattr(timer, mode)(fn)
    except Exception as err:  # noqa: BLE001  (a capture that fails is reported, the run goes on)
        errors.append(f"{name} {mode}: {type(err).__name__}: {str(err)[:200]}")
        return None


def bench_model(ctx, timer, name, tokens, backends, dtype, fused, routing_name, rows, emit):
    E, K, D, F_ = MODELS[name]
    ep, dev = ctx.dims.ep, ctx.device
    S = E // ep
    gen = torch.Generator(device=dev).manual_seed(1)
    w13 = (torch.randn(S, 2 * F_, D, device=dev, generator=gen) * D ** -0.5).to(dtype)
    w2 = (torch.randn(S, D, F_, device=dev, generator=gen) * F_ ** -0.5).to(dtype)
    gate_ED = (torch.randn(E, D, device=dev, generator=gen) * D ** -0.5).to(dtype)
    spec, select = RoutingSpec(num_experts=E, top_k=K), ROUTING_BACKENDS.get(routing_name)

    def fused_fn(x, ids, w):
        return fused(x, ids, w, w13, w2, 0)

    for T in tokens:
        x_TD = torch.randn(T, D, device=dev, generator=torch.Generator(device=dev).manual_seed(100 + ctx.rank)).to(dtype)
        x_all_TD = torch.randn(ep * T, D, device=dev, generator=torch.Generator(device=dev).manual_seed(99)).to(dtype)
        for backend in backends:
            x_TD_b = x_all_TD if backend == "reduce" else x_TD
            policy = "drop" if backend == "capacity" else "dropless"
            routing = RoutingConfig(policy=policy)
            policy_fn = CAPACITY_POLICIES.get(policy)
            kw = dict(capacity_factor=routing.capacity_factor, min_capacity=routing.min_capacity)

            def route():
                logits_TE = x_TD_b @ gate_ED.t()
                w_TK, ids_TK = select(logits_TE, spec, None)
                return policy_fn(ids_TK, w_TK, logits_TE=logits_TE, spec=spec, **kw)

            disp = None
            if backend != "local":
                ctx.cfg = ParallelConfig(ep=ep, dispatcher=backend, overlap=False, overlap_min_mb=0)
                disp = ctx.make_dispatcher(E, K, routing, tokens_replicated=backend == "reduce")
            ids_TK, w_TK = route()
            fns = stage_fns(disp, x_TD_b, ids_TK, w_TK, fused_fn, ep)
            fns["route"] = route
            row = {"model": name, "E": E, "K": K, "D": D, "F": F_, "ep": ep, "tokens_per_rank": T, "backend": backend,
                   "graph_us": {}, "eager_us": {}, "errors": []}
            cols = D + weight_columns(dtype)
            if "plan" in fns:
                plan = fns.pop("plan")
                t = torch.tensor([plan.num_send_rows], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.ep_group)
                row.update(capacity=plan.capacity, payload_rows=int(t.item()),
                           payload_bytes=int(t.item()) * cols * torch.empty((), dtype=dtype).element_size())
                fns["raw_a2a"] = raw_a2a_fn(ctx.ep_group, ep, int(t.item()), cols, dtype, dev)
            graphable = backend != "exact"
            for stage in STAGES:
                if stage in OVERLAP and disp is not None and not getattr(disp, "returns_partial", False):
                    disp.overlap, disp.overlap_micro_batches = True, OVERLAP[stage]
                    fns[stage] = fns["layer"]
                if stage not in fns:
                    continue
                for mode in ("graph", "eager") if graphable or stage == "raw_a2a" else ("eager",):
                    row[f"{mode}_us"][stage] = measure(timer, fns[stage], mode, row["errors"], stage)
            rows.append(row)
            emit()
            del fns
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", default="32,128,512,4096")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = init(ParallelConfig(ep=world, timeout_s=300), device=args.device)
    load_plugins()
    experts_name = resolve_name(EXPERT_BACKENDS, "auto", ctx.device, "experts.backend")
    routing_name = resolve_name(ROUTING_BACKENDS, "auto", ctx.device, "routing.backend")
    fused = getattr(EXPERT_BACKENDS.get(experts_name), "fused_experts", fused_experts_ref)
    timer = Timer(ctx.device, ctx.world_group, args.iters)
    backends = ("local",) if world == 1 else ("exact", "capacity", "reduce")
    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    rows = []
    meta = {"device": device, "num_devices": world, "ep": world, "dtype": args.dtype, "torch": torch.__version__,
            "experts_backend": experts_name, "routing_backend": routing_name, "iters": args.iters,
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "commit": os.environ.get("GIT_COMMIT")}

    def emit():  # the JSON is rewritten after every row: a run cut short keeps what it measured
        if not ctx.is_driver:
            return
        print(json.dumps(rows[-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump({**meta, "results": rows}, f, indent=1)

    for name in args.models.split(","):
        bench_model(ctx, timer, name, [int(t) for t in args.tokens.split(",")], backends, dtype, fused,
                    routing_name, rows, emit)
    if ctx.is_driver:
        summary = print_report(rows, world, device)
        with open(args.out, "w") as f:
            json.dump({**meta, **summary, "results": rows}, f, indent=1)
    ctx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
