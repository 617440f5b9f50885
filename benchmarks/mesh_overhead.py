"""The driver's per-step overhead under a mesh, on CPU with gloo (2 ranks).

    torchrun --nproc-per-node 2 benchmarks/mesh_overhead.py [--out X.json]     # ~1 min on 2 cores

1. The plan of one step, driver to the other rank, per batch shape (decodes with 512-token contexts,
   a 2048-token prefill): `encode` (host time to build the step's tensors), the tensor path the engine
   uses (`StepChannel.broadcast`: header + host ints + flat step tensor, three gloo broadcasts), the
   baseline it replaced (`broadcast_object_list` of the pickled SchedulerOutput, two broadcasts), and the
   floor: one gloo broadcast of the same bytes as one tensor (latency + bytes / loopback bandwidth).
2. The engine: a tiny Qwen3-MoE under tp=2 and under pp=2, 16 requests decoding: per driver step the wall
   time, the time inside the driver's model calls (run_stage + sampling, collectives included), and the
   rest: under tp=2 the driver's overhead (schedule, encode, plan transfer, postprocess); under pp=2 it
   also holds the wait for the other stage (the pipeline's 2 batches in flight share the steps).
Rank 0 prints a table and writes JSON (device in the name) to --out, else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moe_infer.config import ParallelConfig  # noqa: E402
from moe_infer.engine.sampling_params import SamplingParams  # noqa: E402
from moe_infer.engine.sequence import ScheduledSeq, SchedulerOutput  # noqa: E402
from moe_infer.engine.step_inputs import StepEncoder  # noqa: E402
from moe_infer.parallel import init  # noqa: E402
from moe_infer.parallel.channel import StepChannel  # noqa: E402

BLOCK = 16
SHAPES = {  # name -> (sequences, tokens each, context after the step)
    "decode_1": (1, 1, 512), "decode_16": (16, 1, 512), "decode_64": (64, 1, 512), "decode_256": (256, 1, 512),
    "prefill_8x256": (8, 256, 256),
}


def plan_of(num_seqs: int, num_tokens: int, context: int) -> SchedulerOutput:
    params = SamplingParams(temperature=0.0, max_tokens=64)
    seqs = []
    for i in range(num_seqs):
        table = list(range(i * (context // BLOCK + 1), i * (context // BLOCK + 1) + -(-context // BLOCK)))
        seqs.append(ScheduledSeq(seq_id=i, token_ids=list(range(3, 3 + num_tokens)), start_pos=context - num_tokens,
                                 block_table=table, do_sample=True, params=params, num_prompt_tokens=context - 1))
    return SchedulerOutput(seqs=seqs)


def timed(fn, repeats: int, lockstep: bool = True) -> float:
    """Median microseconds of fn() after two warm-up calls (lockstep: both ranks call it, from a barrier)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if lockstep:
            dist.barrier()
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return statistics.median(samples)


def plan_rows(ctx, repeats: int) -> list:
    channel = StepChannel(ctx, 64, torch.float32)
    rows = []
    for name, shape in SHAPES.items():
        plan = plan_of(*shape)
        encoder = StepEncoder(BLOCK)
        msg = encoder.encode(plan)  # the first encode carries the SamplingParams; steady state does not
        msg = encoder.encode(plan)
        nbytes = 8 * (msg.header.numel() + msg.host.numel() + msg.flat.numel())
        pickled = len(__import__("pickle").dumps(plan))
        row = dict(step=name, seqs=shape[0], tokens=shape[0] * shape[1], tensor_bytes=nbytes, pickle_bytes=pickled)
        row["encode_us"] = timed(lambda: encoder.encode(plan), repeats, lockstep=False) if ctx.is_driver else None
        row["tensors_us"] = timed(lambda: channel.broadcast(msg if ctx.is_driver else None), repeats)
        box = [plan if ctx.is_driver else None]
        row["pickle_us"] = timed(lambda: dist.broadcast_object_list(box, src=0, group=ctx.control_group), repeats)
        raw = torch.zeros(nbytes // 8, dtype=torch.int64)
        row["floor_us"] = timed(lambda: dist.broadcast(raw, src=0, group=ctx.stage_group), repeats)
        rows.append(row)
    return rows


def engine_rows(path: str, ctx_sizes: dict, num_requests: int, new_tokens: int) -> dict:
    from moe_infer import LLM

    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=512, max_model_len=256,
              **ctx_sizes)
    runner, inside = llm.engine.runner, []
    for name in ("run_stage", "sample_step"):
        fn = getattr(runner, name)

        def wrapped(*a, _fn=fn, **kw):
            t = time.perf_counter()
            out = _fn(*a, **kw)
            inside.append(time.perf_counter() - t)
            return out

        setattr(runner, name, wrapped)
    steps = []
    if llm.engine.parallel.is_driver:
        step = llm.engine.step

        def timed_step(*a, **kw):
            t = time.perf_counter()
            out = step(*a, **kw)
            steps.append((time.perf_counter() - t, sum(inside)))
            inside.clear()
            return out

        llm.engine.step = timed_step
    prompts = [{"prompt_token_ids": list(range(3 + i, 35 + i))} for i in range(num_requests)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    if not steps:
        return {}
    decode = steps[len(steps) // 4:]  # past the prefill
    wall = statistics.median(s for s, _ in decode) * 1e6
    model = statistics.median(m for _, m in decode) * 1e6
    return dict(steps=len(steps), step_us=wall, model_us=model, driver_overhead_us=wall - model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 2:
        raise SystemExit("run under torchrun with 2 processes: torchrun --nproc-per-node 2 benchmarks/mesh_overhead.py")
    ctx = init(ParallelConfig(tp=2, timeout_s=60), device="cpu")
    plans = plan_rows(ctx, args.repeats)
    tmp = tempfile.mkdtemp(prefix="mesh_bench_") if ctx.is_driver else None
    path = ctx.broadcast_object(tmp and os.path.join(tmp, "qwen3"))  # one machine: rank 0 writes, both read
    if ctx.is_driver:
        from tiny_hf import make_tiny_checkpoint

        make_tiny_checkpoint("qwen3_moe", path, seed=0, num_hidden_layers=2)
    ctx.broadcast_object(None)  # the checkpoint is written
    engines = {name: engine_rows(path, sizes, 16, 24) for name, sizes in (("tp2", dict(tp=2)), ("pp2", dict(pp=2)))}
    if not ctx.is_driver:
        return
    shutil.rmtree(tmp, ignore_errors=True)
    result = dict(benchmark="mesh_overhead", device="cpu", backend="gloo", ranks=2, torch=torch.__version__,
                  threads=torch.get_num_threads(), cpus=os.cpu_count(), load_average=os.getloadavg(), plans=plans,
                  engines=engines)
    print("plan of one step, driver -> 1 rank (gloo, loopback), median us")
    print(f"{'step':>14} {'tokens':>6} {'tensor B':>9} {'pickle B':>9} {'encode':>7} {'tensors':>8} {'pickle':>8} {'floor':>7}")
    for r in plans:
        print(f"{r['step']:>14} {r['tokens']:>6} {r['tensor_bytes']:>9} {r['pickle_bytes']:>9} {r['encode_us']:>7.0f} "
              f"{r['tensors_us']:>8.0f} {r['pickle_us']:>8.0f} {r['floor_us']:>7.0f}")
    print("engine, tiny qwen3_moe, 16 requests decoding, median per driver step (us)")
    for name, e in engines.items():
        print(f"{name:>5}: step {e['step_us']:.0f}, in the driver's model calls {e['model_us']:.0f}, "
              f"rest {e['driver_overhead_us']:.0f} ({e['driver_overhead_us'] / e['step_us']:.0%})")
    from benchmarks.e2e_generate import write_result

    write_result(result, "mesh_overhead_cpu_gloo_2ranks.json", args.out)


if __name__ == "__main__":
    main()
