"""torchrun worker: a rank that dies or hangs in the middle of generation gives a clear error naming it.

    torchrun --nproc-per-node 2 tests/dist/mesh_failure_worker.py CHECKPOINT kill|leave|stop tp|pp
    torchrun --nproc-per-node 2 tests/dist/mesh_failure_worker.py - exit

At its third step rank 1 SIGKILLs itself (kill: torchrun sees the failed worker, tears the others down
and names it), leaves with exit code 0 (leave: torchrun waits, rank 0 must find out), or SIGSTOPs
itself and a helper process wakes it (SIGCONT) 15 s later (stop). tp: tensor parallel (rank 0 waits in
a collective); pp: two pipeline stages (rank 0 waits for the last stage's tokens). parallel.timeout_s
is 4 s: rank 0 must raise naming rank 1 well before rank 1 would wake. exit: start the mesh, run
collectives and leave without `shutdown()` (the exit hook must tear the groups down: no abort).
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from moe_infer.config import ParallelConfig  # noqa: E402
from moe_infer.parallel import MeshError, init  # noqa: E402


def leave_without_shutdown() -> int:
    rank = int(os.environ["RANK"])
    # registered before init's exit hook, so it runs after it (atexit is last in, first out)
    atexit.register(lambda: print(f"rank {rank}: process groups at interpreter exit: "
                                  f"{'alive' if dist.is_initialized() else 'destroyed'}", flush=True))
    ctx = init(ParallelConfig(tp=int(os.environ["WORLD_SIZE"]), timeout_s=30), device="cpu")
    t = torch.ones(4096)
    for _ in range(20):
        dist.all_reduce(t, group=ctx.world_group)
    ctx.broadcast_object({"rank": ctx.rank})
    print(f"rank {ctx.rank} leaves", flush=True)
    return 0


def main(checkpoint: str, mode: str, layout: str = "tp") -> int:
    if mode == "exit":
        return leave_without_shutdown()
    from moe_infer import LLM, SamplingParams

    rank = int(os.environ["RANK"])
    sizes = dict(tp=2) if layout == "tp" else dict(pp=2)
    llm = LLM(model=checkpoint, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128,
              timeout_s=4, **sizes)
    if rank == 1:
        runner, calls = llm.engine.runner, []
        forward_step = runner.forward_step

        def failing_forward_step(*args):
            calls.append(1)
            if len(calls) == 3:
                print(f"rank 1: {mode} at its third step", flush=True)
                if mode == "leave":
                    os._exit(0)
                if mode == "stop":
                    subprocess.Popen(["sh", "-c", f"sleep 15; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
            return forward_step(*args)

        runner.forward_step = failing_forward_step
    start = time.time()
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 2, SamplingParams(max_tokens=16, ignore_eos=True),
                     use_tqdm=False)
    except MeshError as err:
        print(f"rank {rank} raised after {time.time() - start:.1f} s: {err}", flush=True)
        os._exit(3)  # the process group is broken: no teardown
    print(f"rank {rank}: no error", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
