"""build_app: the FastAPI app over an engine (routes, errors in OpenAI's shape, admission, lifespan).

The app's lifespan starts the engine loop and, on shutdown, drains it (`serve.drain_timeout_s`)
then aborts what is left. Every error leaves as `{"error": {"message", "type", "param", "code"}}`:
a malformed body or a value out of range is a 400 naming the field (FastAPI's 422 is mapped to
400, as OpenAI answers), an unknown model 404, a full queue 429 with Retry-After, a stopped engine 503.
"""
from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from moe_infer.engine.request_streams import RequestFailed, StreamingEngine
from moe_infer.server import chat, completions, info, metrics
from moe_infer.server.config import ServeConfig
from moe_infer.server.middleware import AdmissionMiddleware
from moe_infer.server.protocol import now_s
from moe_infer.server.serving import ApiError, ServerState, error_response

logger = logging.getLogger(__name__)


def build_app(engine: StreamingEngine, cfg: ServeConfig, model_path: str) -> FastAPI:
    """The app over an engine whose loop runs in its own process (ProcessEngine, the default) or in a thread
    of this one (AsyncEngine): both answer the same calls."""
    state = ServerState(engine=engine, cfg=cfg, model_name=cfg.served_model_name or _model_name(model_path),
                        model_path=model_path, tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
                        created=now_s(), metrics=metrics.ServerMetrics())
    engine.on_finished.append(state.metrics.on_finished)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown(drain_timeout_s=cfg.drain_timeout_s)

    try:
        version = metadata.version("moe_infer")
    except metadata.PackageNotFoundError:
        version = "unknown"
    app = FastAPI(title="moe_infer: an OpenAI-compatible MoE server", version=version, lifespan=lifespan)
    app.state.server = state
    for module in (completions, chat, info, metrics):
        app.include_router(module.router)
    api_key = cfg.api_key or os.environ.get("MOE_INFER_API_KEY") or None
    app.add_middleware(AdmissionMiddleware, api_key=api_key, max_request_bytes=cfg.max_request_bytes)
    _add_error_handlers(app)
    return app


def _model_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path)) or path


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError):
        return error_response(err.status, err.message, err.param, err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError):
        problems, param = [], None
        for e in err.errors():
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            field = ".".join(loc) or "body"
            param = param or field
            problems.append(f"{field}: {e.get('msg')}")
        return error_response(400, "; ".join(problems[:5]) or "invalid request", param)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException):
        return error_response(err.status_code, str(err.detail), headers=getattr(err, "headers", None))

    @app.exception_handler(RequestFailed)
    async def failed(_: Request, err: RequestFailed):
        return error_response(500, str(err))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(err).__name__}: {err}")
