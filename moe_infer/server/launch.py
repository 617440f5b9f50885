"""The `serve` entry: `moe-infer serve [hydra overrides] [--port 8001 --api-key KEY ...]`.

    moe-infer serve model=hf model.path=/ckpt/Qwen3-30B-A3B serve.port=8000
    torchrun --nproc-per-node 4 -m moe_infer.launch serve model=hf model.path=... parallel=ep parallel.ep=4

Composes the same conf/config.yaml as the main job (every group, plus `serve`); `--name value` and
`--name=value` are shorthands for `serve.name=value` (vLLM's `--api-key`, `--port`, ...). Every rank
builds the engine; the driver rank (RANK 0) serves HTTP (uvicorn) and the other ranks run the driver's steps
(`moe_infer.parallel.pipeline.serve`) until it shuts down. On the driver the engine runs in a process of
its own (`serve.engine_loop=process`, moe_infer/engine/core_proc.py), which joins the mesh as rank 0;
with `serve.api_server_count=N` N HTTP processes share that core (moe_infer/server/multi.py).
`serve(engine_cfg, serve_cfg)` is the same without Hydra.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import List, Optional

from moe_infer.config import EngineConfig
from moe_infer.server.config import ServeConfig
from moe_infer.server.uvicorn_run import run_uvicorn

logger = logging.getLogger(__name__)


def serve(engine_cfg: EngineConfig, serve_cfg: ServeConfig) -> None:
    from moe_infer.server.app import build_app

    path = engine_cfg.model.path
    if path is None:
        from moe_infer.assets import default_model_path

        path = default_model_path()
    path = str(path)
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: a rank that runs the driver's steps until it shuts down
        _serve_steps(engine_cfg, path)
        return
    max_requests = engine_cfg.scheduler.max_num_seqs + serve_cfg.max_queued_requests
    if serve_cfg.api_server_count > 1:
        from moe_infer.server.multi import serve_many

        code = serve_many(engine_cfg, serve_cfg, path, max_requests)
        if code:
            raise SystemExit(code)
        return
    engine, finish = _driver_engine(engine_cfg, serve_cfg, path, max_requests)
    try:
        run_uvicorn(build_app(engine, serve_cfg, path), serve_cfg)
    finally:
        finish()


def _driver_engine(engine_cfg: EngineConfig, serve_cfg: ServeConfig, path: str, max_requests: int):
    """(the engine the app serves, what stops it after the server); serve.engine_loop picks where its loop runs."""
    if serve_cfg.engine_loop == "process":
        from moe_infer.engine.core_client import ProcessEngine

        engine = ProcessEngine(engine_cfg, path, max_requests=max_requests)
        return engine, engine.close  # after a clean shutdown the core has stopped already: close just joins
    from moe_infer.engine.async_engine import AsyncEngine
    from moe_infer.engine.llm_engine import LLMEngine

    core = LLMEngine(engine_cfg, path)
    sys.setswitchinterval(serve_cfg.gil_switch_interval_s)  # see ServeConfig
    return AsyncEngine(core, max_requests=max_requests), core.parallel.shutdown


def _serve_steps(engine_cfg: EngineConfig, path: str) -> None:
    from moe_infer.engine.llm_engine import LLMEngine
    from moe_infer.parallel.follower import serve as run_driver_steps

    engine = LLMEngine(engine_cfg, path)
    try:
        run_driver_steps(engine.parallel, engine.runner)
    finally:
        engine.parallel.shutdown()


def flags_to_overrides(argv: List[str]) -> List[str]:
    """`--port 8001`, `--api-key=K` -> `serve.port=8001`, `serve.api_key=K`; other arguments unchanged."""
    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else None
        if name in fields:
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise SystemExit(f"{arg} needs a value")
            out.append(f"serve.{name}={value}")
        else:
            out.append(arg)
        i += 1
    return out


def main(argv: Optional[List[str]] = None) -> None:
    import hydra
    from omegaconf import DictConfig

    from moe_infer.launch_config import CONF_DIR
    from moe_infer.launch_config import to_job

    sys.argv = [sys.argv[0]] + flags_to_overrides(sys.argv[1:] if argv is None else argv)

    @hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
    def _serve(cfg: DictConfig) -> None:
        job = to_job(cfg)
        serve(job.engine_config(), job.serve)

    _serve()
