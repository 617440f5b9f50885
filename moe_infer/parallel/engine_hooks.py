"""The engine's hooks into expert parallelism: every rank builds the engine, rank 0 drives it.

Rank 0 (the driver) runs the scheduler; before each forward it broadcasts the step's plan (a
picklable `SchedulerOutput`: token ids, positions, block tables, sampling params) and every rank
runs the same forward on it: attention replicated, the MoE layers' experts split over the EP ranks
(`tokens_replicated`: each rank routes 1/ep of the step's tokens and all-gathers the outputs).
Tokens sampled on other ranks are never used: the driver's scheduler appends its own, so ranks
cannot drift apart even where two ranks' logits differ in the last bit. The other ranks run
`serve_steps` inside `LLM.generate` until the driver sends the end marker, then return the
driver's outputs. Rank 0 alone prints (see `moe_infer.launch`).

    init_engine_parallel(cfg)            LLMEngine.__init__, before anything touches the device
    expert_dispatcher(ctx, cfg, path)    ModelRunner, before load_model: MoEBackends.dispatcher
    agree_min(ctx, n)                    ModelRunner: the KV block count every rank can hold
    run_step(ctx, runner, plan)          LLMEngine.step, instead of runner.execute(plan)
    serve_steps(ctx, runner)             LLM.generate on ranks other than the driver
    end_steps(ctx, outputs)              LLM.generate on the driver, when it is done
    keep_alive(ctx, empty_plan)          AsyncEngine on the driver while idle (no collective timeout)
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from moe_infer.config import EngineConfig
from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.parallel.context import ParallelContext, init

logger = logging.getLogger(__name__)
_END = "__moe_infer_end_of_steps__"


def init_engine_parallel(cfg: EngineConfig) -> ParallelContext:
    """Process group + meshes when launched with parallel.ep > 1 (checks every rank has cfg)."""
    return init(cfg.parallel, cfg.model.device, config_to_check=cfg)


def expert_dispatcher(ctx: ParallelContext, cfg: EngineConfig, model_path: str) -> Optional[LocalDispatcher]:
    """The EP dispatcher for the model at model_path, or None on one rank (the layer's default)."""
    if ctx.dims.ep == 1:
        return None
    from moe_infer.models.arch import load_arch

    arch, _ = load_arch(model_path)
    return ctx.make_dispatcher(arch.num_experts, arch.top_k, cfg.routing, tokens_replicated=True)


def agree_min(ctx: ParallelContext, value: int) -> int:
    """The smallest value over the ranks (e.g. KV blocks: the driver's block ids must exist everywhere)."""
    if not ctx.is_distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=ctx._object_device() or "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.world_group)
    return int(t.item())


def run_step(ctx: ParallelContext, runner: Any, plan: Any):
    """Driver side of one step: send the plan to the other ranks, then run it here too."""
    if ctx.is_distributed and not plan.is_empty:
        ctx.broadcast_object(plan)
    return runner.execute(plan)


def serve_steps(ctx: ParallelContext, runner: Any) -> List[Any]:
    """Non-driver ranks: run every plan the driver sends until its end marker; returns its outputs."""
    while True:
        plan = ctx.broadcast_object(None)
        if isinstance(plan, str) and plan == _END:
            return ctx.broadcast_object(None)
        try:
            runner.execute(plan)
        except Exception:  # the driver fails this step's requests and goes on; so does this rank
            logger.exception("EP rank %d: forward of a step failed", ctx.rank)


def end_steps(ctx: ParallelContext, outputs: List[Any]) -> List[Any]:
    """Driver: release the other ranks from `serve_steps` and hand them the outputs."""
    if ctx.is_distributed:
        ctx.broadcast_object(_END)
        ctx.broadcast_object(outputs)
    return outputs


def keep_alive(ctx: ParallelContext, empty_plan: Any) -> None:
    """Driver, while a server is idle: an empty plan (a no-op step on every rank), so that the other
    ranks' wait in `serve_steps` never reaches the collective timeout."""
    if ctx.is_distributed:
        ctx.broadcast_object(empty_plan)
