"""The engine's hooks into the mesh: every rank builds the engine, rank 0 drives it.

Rank 0 (the driver) runs the scheduler; each step's plan goes to the other ranks as tensors
(`step_message.py`) and every rank runs its part: its pipeline stage's layers, its attention heads
and shards (tp), its experts (ep). Tokens are sampled once, on the first rank of the last stage,
and come back to the driver, whose scheduler alone appends them: ranks cannot drift apart. The other
ranks run `serve` inside `LLM.generate` until the driver's END, then return the driver's outputs.
Rank 0 alone prints (see `moe_infer.launch`) and logs its INFO notes (`rank_logs.py`).

    init_engine_parallel(cfg, path)      LLMEngine.__init__, before anything touches the device
    expert_dispatcher(ctx, cfg, path)    ModelRunner, before load_model: MoEBackends.dispatcher
    make_executor(ctx, runner, lookahead)  LLMEngine: the `run` of schedule -> run -> postprocess
    serve(ctx, runner)                   LLM.generate on ranks other than the driver
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict
from typing import Any, Optional

from moe_infer.config import EngineConfig
from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.parallel.context import ParallelContext
from moe_infer.parallel.follower import serve
from moe_infer.parallel.pipeline import LocalExecutor, MeshExecutor
from moe_infer.parallel.rank_logs import quiet_follower_logs
from moe_infer.parallel.startup import init

__all__ = ["checkpoint_fingerprint", "expert_dispatcher", "init_engine_parallel", "make_executor", "serve"]


def checkpoint_fingerprint(path: str) -> str:
    """The checkpoint's identity across machines (its config and file sizes), not its local path."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == "config.json":
            with open(full, "rb") as f:
                h.update(f.read())
        elif name.endswith(".safetensors"):
            h.update(f"{name}:{os.path.getsize(full)}".encode())
    return h.hexdigest()[:16]


def init_engine_parallel(cfg: EngineConfig, model_path: Optional[str] = None) -> ParallelContext:
    """The mesh when launched under torchrun with tp, pp or ep > 1; checks every rank has the same config
    and checkpoint (compared by content: the folder may sit at another path on another machine)."""
    if cfg.offload.store != "resident" and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        raise ValueError(f"offload.store={cfg.offload.store!r} with parallel.tp={cfg.parallel.tp}, parallel.pp="
                         f"{cfg.parallel.pp}: offloaded experts work with expert parallelism only (tp = pp = 1)")
    if cfg.parallel.dp_attention:
        _check_dp_attention(cfg)
    check = asdict(cfg)
    if model_path is not None and os.path.isdir(model_path):
        check["model"]["path"] = checkpoint_fingerprint(model_path)
    ctx = init(cfg.parallel, cfg.model.device, config_to_check=check)
    if ctx.is_distributed:
        quiet_follower_logs(ctx.rank)  # the start-up notes that follow: rank 0's only
    return ctx


def _check_dp_attention(cfg: EngineConfig) -> None:
    """What attention data parallelism runs with (the replicas' tokens meet in the reduce dispatcher)."""
    p = cfg.parallel
    why = None
    if p.dispatcher not in ("auto", "reduce"):
        why = f"parallel.dispatcher={p.dispatcher} (it runs the reduce dispatcher: auto or reduce)"
    elif cfg.offload.store != "resident":
        why = f"offload.store={cfg.offload.store} (resident experts only)"
    elif cfg.routing.policy != "dropless":
        why = f"routing.policy={cfg.routing.policy} (a capacity over the gathered rows would count the padding rows)"
    elif cfg.routing.trace:
        why = "routing.trace=true (the recorder sees one replica's rows)"
    elif p.enable_eplb:
        why = "parallel.enable_eplb=true (not supported yet)"
    if why is not None:
        raise ValueError(f"parallel.dp_attention=true does not run with {why}")


def expert_dispatcher(ctx: ParallelContext, cfg: EngineConfig, model_path: str) -> Optional[LocalDispatcher]:
    """The EP dispatcher for the model at model_path, or None without expert parallelism (the layer's default)."""
    if ctx.dims.ep == 1:
        return None
    from moe_infer.models.hf_config import load_arch

    arch, _ = load_arch(model_path)
    return ctx.make_dispatcher(arch.num_experts, arch.top_k, cfg.routing, tokens_replicated=True,
                               resident=cfg.offload.store == "resident")


def make_executor(ctx: ParallelContext, runner: Any, lookahead: bool = False) -> LocalExecutor:
    """The driver's executor under a mesh (lookahead: async scheduling), else the one-rank synchronous one (the
    one-rank async executor is the engine's own: moe_infer/engine/async_scheduling.py)."""
    return MeshExecutor(ctx, runner, lookahead) if ctx.is_distributed else LocalExecutor(runner)
