"""One layout of benchmarks/mesh_scaling.py: the worker process (torchrun of G ranks, or a plain process at world 1).

    python benchmarks/mesh_scaling_worker.py SPEC_JSON        # started by mesh_scaling.py, one per layout and model

SPEC_JSON (a JSON string): the model's dims and config folder (random weights, `model.load_format=dummy`), the
layout (tp, pp, ep), the batches, prompt and output lengths, the prefill shape, `ab` (world 1: the plain engine and
the mesh's path at degree 1, `parallel.force_mesh`, in one process, timed A B B A) and `out`, where rank 0 writes
per engine the decode and prefill timings and, on several ranks, the raw collectives of the same run.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from e2e_generate import clock, clock_in_graph, time_ours  # noqa: E402


def gen_ids(seed: int, b: int, n: int, vocab: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (b, n), generator=gen).tolist()


def timed_generate(llm, prompts, new: int, device) -> float:
    return time_ours(llm, prompts, new, device)[0]


def raw_collectives(ctx, sizes: list, hidden: int, dtype, device) -> dict:
    """Median seconds of an all-reduce of [T, hidden] over the stage (eager, and per call inside a CUDA graph of 20)
    and of a point-to-point [T, hidden] from stage 0 to stage 1, per T; every rank takes part."""
    import torch.distributed as dist

    out = {}
    stage = ctx.stage_axis().group  # the group the engine's stage collectives use

    for T in sizes:
        x = torch.ones(T, hidden, dtype=dtype, device=device)
        row = {}
        if ctx.dims.stage_size > 1:
            row["all_reduce_s"] = clock(lambda: dist.all_reduce(x, group=stage), device, reps=20, warmup=3)
            if device.type == "cuda":  # per call, 20 calls in one graph
                row["all_reduce_graph_s"] = clock_in_graph(lambda: dist.all_reduce(x, group=stage), device, reps=10)
        if ctx.dims.pp > 1:
            first, second = ctx.dims.rank_of(0, ctx.stage_index), ctx.dims.rank_of(1, ctx.stage_index)

            def p2p():
                if ctx.rank == first:
                    dist.send(x, second)
                elif ctx.rank == second:
                    dist.recv(x, first)
            row["p2p_s"] = clock(p2p, device, reps=20, warmup=3)
        out[str(T)] = row
    if device.type == "cuda" and ctx.dims.stage_size > 1:
        for T, row in symm_mem_all_reduce(stage, sizes, hidden, dtype, device).items():
            out.setdefault(T, {}).update(row)
    return out


def symm_mem_all_reduce(group, sizes: list, hidden: int, dtype, device) -> dict:
    """PyTorch's symmetric-memory all-reduces of [T, hidden] over group (one-shot and two-shot: peer-to-peer loads
    over NVLink, no multicast), median seconds a call eagerly and inside a CUDA graph, per T: the candidates for the
    TP all-reduce at decode sizes, against NCCL's of the same run. An op that cannot run records its error."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(max(sizes), hidden, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group)
        name = group.group_name
    except Exception as err:  # noqa: BLE001 - an older torch, no P2P between the GPUs: reported, not fatal
        return {"error": {"symm_mem_error": f"{type(err).__name__}: {err}"[:300]}}
    ops = {"one_shot": lambda x: torch.ops.symm_mem.one_shot_all_reduce(x, "sum", name),
           "two_shot": lambda x: torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", name)}
    out = {}
    for T in sizes:
        x, row = buf[:T], {}
        x.fill_(1.0)
        for op, fn in ops.items():
            try:
                row[f"symm_{op}_s"] = clock(lambda: fn(x), device, reps=20, warmup=3)
                row[f"symm_{op}_graph_s"] = clock_in_graph(lambda: fn(x), device, reps=10)
            except Exception as err:  # noqa: BLE001
                row[f"symm_{op}_error"] = f"{type(err).__name__}: {err}"[:300]
        out[str(T)] = row
    return out


def progress(start: float, what: str) -> None:
    """A time-stamped progress line of rank 0 (the driver prints the last ones when a layout fails or times out)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[{time.perf_counter() - start:7.1f} s] {what}", flush=True)


def run_layout(spec: dict) -> None:
    """One layout (or, at world 1, the plain engine and the mesh path in A B B A order) on one model."""
    from moe_infer import LLM

    start = time.perf_counter()
    faulthandler.dump_traceback_later(spec.get("watchdog_s", 1800), exit=True)  # a hang: every thread's stack
    if os.environ.get("RANK", "0") == "0":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    dims, tp, pp, ep = spec["dims"], spec["tp"], spec["pp"], spec["ep"]
    device = torch.device("cuda" if spec["device"] == "cuda" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches, P, N = spec["batches"], spec["prompt_len"], spec["new_tokens"]
    pf_seqs, pf_len = spec["prefill"]
    blocks = max(max(batches) * (P + N + 16), pf_seqs * (pf_len + 16)) // 16 + 64
    kw = dict(model=spec["ckpt"], load_format="dummy", dtype=str(dtype).split(".")[-1], device=str(device),
              max_num_seqs=max(batches), max_num_batched_tokens=max(pf_seqs * pf_len, 2048),
              max_model_len=max(P + N, pf_len + 1) + 16, num_kv_blocks=blocks, enable_prefix_caching=False,
              cuda_graph_max_batch=max(batches), tp=tp, pp=pp, ep=ep, dp_attention=spec.get("dp_attention", False))
    if spec["ab"]:  # world 1: the plain engine (A) and the mesh's code path at degree 1 (B), one process
        engines = {"one GPU": LLM(**kw)}
        progress(start, "one GPU engine built")
        engines["mesh x1"] = LLM(**kw, force_mesh=True)
        order = ["one GPU", "mesh x1", "mesh x1", "one GPU"]
    else:
        engines = {spec["name"]: LLM(**kw)}
        order = [spec["name"]]
    progress(start, "engines built")
    first = next(iter(engines.values()))
    ctx = first.engine.parallel
    V = dims["vocab_size"]
    for llm in engines.values():  # warm-up: every batch shape and the prefill shape (compiles, graph captures)
        for b in batches:
            timed_generate(llm, gen_ids(1000 + b, b, P, V), 3, device)
            progress(start, f"warm-up at batch {b}")
        timed_generate(llm, gen_ids(999, pf_seqs, pf_len, V), 1, device)
        progress(start, "warm-up of the prefill")
    rows = {name: {"decode": {}, "prefill": {}} for name in engines}
    for b in batches:
        prompts = gen_ids(b, b, P, V)
        for name in order:
            full = timed_generate(engines[name], prompts, N, device)
            prefill = timed_generate(engines[name], prompts, 1, device)
            rows[name]["decode"].setdefault(str(b), []).append(dict(full_s=full, prefill_s=prefill))
            progress(start, f"{name} batch {b}: {full:.3f} s")
    for name in order:
        prompts = gen_ids(7, pf_seqs, pf_len, V)
        rows[name]["prefill"].setdefault("s", []).append(
            statistics.median(timed_generate(engines[name], prompts, 1, device) for _ in range(3)))
    result = {}
    for name, row in rows.items():
        decode = {}
        for b, runs in row["decode"].items():
            full = statistics.mean(r["full_s"] for r in runs)
            prefill = statistics.mean(r["prefill_s"] for r in runs)
            decode[b] = dict(tok_s=int(b) * N / full, full_s=full, step_ms=1e3 * max(full - prefill, 0.0) / (N - 1),
                             runs=len(runs), runs_full_s=[r["full_s"] for r in runs])
        pf = statistics.mean(row["prefill"]["s"])
        result[name] = dict(decode=decode, prefill=dict(tok_s=pf_seqs * pf_len / pf, s=pf))
    raw = {}
    if ctx.is_distributed and ctx.dims.world_size > 1:
        raw = raw_collectives(ctx, batches + [pf_seqs * pf_len], dims["hidden_size"], dtype, device)
    if ctx.rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(dict(rows=result, raw=raw, world=ctx.dims.world_size if ctx.is_distributed else 1), f)
    faulthandler.dump_traceback_later(60, exit=True)  # the teardown: a hang there fails the layout in a minute
    for llm in engines.values():
        llm.shutdown()
    progress(start, "shut down")


if __name__ == "__main__":
    run_layout(json.loads(sys.argv[1]))
