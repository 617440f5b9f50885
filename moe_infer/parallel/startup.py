"""Start-up of the mesh under torchrun: `init(cfg.parallel) -> ParallelContext`.

torchrun (its c10d rendezvous, one or many machines) sets RANK, WORLD_SIZE, LOCAL_RANK and the
store; `init` checks the world against the parallel sizes before anything else (so a mismatch fails
at once on every rank, naming the sizes), starts the default process group (NCCL on CUDA, gloo on
CPU) with `parallel.timeout_s` on every collective of a step, builds the meshes and the CPU control
groups, and checks that every rank was given the same config.

Exit: gloo's worker threads may still hold the last collective's tensors when the interpreter
shuts down; dropping them then needs the GIL, which a finalizing interpreter no longer gives, and
the process aborts ("terminate called without an active exception", seen in 2 of 15 torchrun runs
of the Python API). So `init` registers an atexit hook that destroys the process groups while the
interpreter is still whole, drops this module's references to them, and releases the GIL for a
moment so that a worker still dropping a tensor can finish (skipped after a MeshError: a collective
teardown could then hang).
"""
from __future__ import annotations

import atexit
import math
import os
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_infer.config import ParallelConfig
from moe_infer.parallel.context import ParallelContext
from moe_infer.parallel.dims import ParallelDims

# Waits on the control groups: a rank idles there between requests for as long as the driver does, and
# the start-up agreement waits for the slowest rank to load its weights. A peer that dies is still
# reported at once (its connection closes).
CONTROL_TIMEOUT = timedelta(days=7)
_contexts: list = []  # every context of this process, for the exit hook


def needed_processes(cfg: ParallelConfig) -> int:
    return cfg.pp * (cfg.tp * cfg.ep // math.gcd(cfg.tp, cfg.ep))


def _teardown() -> None:
    if dist.is_initialized() and not any(ctx.failed for ctx in _contexts):
        ParallelContext.run_before_teardown()
        dist.destroy_process_group()
        _contexts.clear()
        time.sleep(0.1)  # the GIL, released: gloo's workers drop their last work objects now, not in finalization


def _device(device: str, local_rank: int) -> torch.device:
    use_cuda = (device == "auto" and torch.cuda.is_available()) or device.startswith("cuda")
    if not use_cuda:
        return torch.device("cpu")
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    return dev


def init(cfg: ParallelConfig, device: str = "auto", config_to_check: Any = None) -> ParallelContext:
    """Start the mesh (under torchrun) or return a single-rank context (tp = pp = ep = 1, one process).

    config_to_check: what every rank must hold the same of (the engine config); checked at start-up.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    needed = needed_processes(cfg)
    if cfg.dp_attention:  # raises, naming the sizes, where there are no attention replicas (dp = 1)
        ParallelDims(needed, pp=cfg.pp, tp=cfg.tp, ep=cfg.ep, dp_attention=True)
    if world_size == 1 and needed == 1 and not cfg.force_mesh:
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                           ("cpu" if device == "auto" else device))
        return ParallelContext(cfg=cfg, dims=ParallelDims(1), rank=0, device=dev)
    if "RANK" not in os.environ and needed == 1:  # parallel.force_mesh in a plain process: a world of one rank
        return _start(cfg, device, 0, 1, 0, dist.HashStore(), config_to_check)
    if "RANK" not in os.environ:
        raise RuntimeError(
            f"parallel.tp={cfg.tp}, parallel.pp={cfg.pp}, parallel.ep={cfg.ep} run as {needed} processes: start "
            f"them with torchrun, e.g. `torchrun --nproc-per-node {needed} -m moe_infer.launch parallel.tp={cfg.tp} "
            f"parallel.pp={cfg.pp} parallel.ep={cfg.ep} ...` (several machines: docs/scaling.md)")
    return _start(cfg, device, int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")), None,
                  config_to_check)


def _start(cfg: ParallelConfig, device: str, rank: int, world_size: int, local_rank: int, store: Any,
           config_to_check: Any) -> ParallelContext:
    """The process groups and meshes of this rank (store None: torchrun's environment rendezvous)."""
    # raises naming the sizes on a mismatch
    dims = ParallelDims(world_size, pp=cfg.pp, tp=cfg.tp, ep=cfg.ep, dp_attention=cfg.dp_attention)
    dev = _device(device, local_rank)
    if not dist.is_initialized():
        kwargs = {} if store is None else dict(store=store, rank=rank, world_size=world_size)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.timeout_s),
                                **kwargs)
        atexit.register(_teardown)
    mesh, moe_mesh, stage_mesh = dims.build_meshes(dev.type)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    stage_control: Optional[dist.ProcessGroup] = None
    for stage in range(dims.pp):  # every rank takes part in creating every group
        ranks = [dims.rank_of(stage, i) for i in range(dims.stage_size)]
        group = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)
        if rank in ranks:
            stage_control = group
    ctx = ParallelContext(cfg=cfg, dims=dims, rank=rank, device=dev, mesh=mesh, moe_mesh=moe_mesh,
                          stage_mesh=stage_mesh, world_group=dist.group.WORLD, control_group=control,
                          stage_control_group=stage_control)
    if ctx.sampler_rank != 0:
        ctx.results_group = dist.new_group([0, ctx.sampler_rank], backend="gloo",
                                           timeout=timedelta(seconds=cfg.timeout_s))
    _contexts.append(ctx)
    ctx.check_same_config(config_to_check if config_to_check is not None else cfg)
    return ctx
