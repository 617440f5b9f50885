"""torchrun worker: failures give clear errors, not hangs.

    torchrun --nproc-per-node 2 tests/dist/ep_failure_worker.py config_mismatch|dead_rank|hung_rank

config_mismatch: rank 1 starts with another dispatcher; `init` must raise on every rank, naming
    the field. dead_rank: rank 1 leaves right after start-up; rank 0's next MoE layer must raise
    an "EP all-to-all failed" error. hung_rank: rank 1 stays alive but never joins the all-to-all;
    rank 0 must raise once the collective timeout (3 s) has passed, well before rank 1 wakes (20 s).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from moe_infer.config import EngineConfig, ParallelConfig, RoutingConfig  # noqa: E402
from moe_infer.layers.moe import MoEBackends, MoELayer  # noqa: E402
from moe_infer.parallel import init  # noqa: E402
from moe_infer.routing.spec import RoutingSpec  # noqa: E402


def main(mode: str) -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if mode == "config_mismatch":
        pcfg = ParallelConfig(ep=world, timeout_s=30, dispatcher="capacity" if rank == 1 else "exact")
        try:
            init(pcfg, device="cpu", config_to_check=EngineConfig(parallel=pcfg))
        except ValueError as err:
            print(f"rank {rank} raised: {err}", flush=True)
            return 3
        print(f"rank {rank}: no error", flush=True)
        return 0
    ctx = init(ParallelConfig(ep=world, timeout_s=3), device="cpu")
    if rank == 1 and mode == "dead_rank":
        print("rank 1 leaves", flush=True)
        os._exit(0)
    if rank == 1:
        time.sleep(20)
        print("rank 1 leaves after 20 s", flush=True)
        os._exit(0)
    spec = RoutingSpec(num_experts=4, top_k=2)
    disp = ctx.make_dispatcher(4, 2, RoutingConfig(), tokens_replicated=False)
    layer = MoELayer(0, 8, 8, spec, MoEBackends(dispatcher=disp), torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    start = time.time()
    try:
        with torch.no_grad():
            for _ in range(3):
                layer(torch.randn(5, 8))
    except RuntimeError as err:
        print(f"rank {rank} raised after {time.time() - start:.1f} s: {err}", flush=True)
        return 3
    print(f"rank {rank}: no error", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
