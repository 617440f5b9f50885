"""A real uvicorn server on a loopback port (port 0: the OS picks) over the shipped tiny MoE, in a thread.

    with live_server(max_num_seqs=4, serve=dict(api_key="k")) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="k")

The engine runs where `serve.engine_loop` says, as under `moe-infer serve`: by default in a process of its
own (ProcessEngine), or with engine_loop="thread" in a thread beside uvicorn (AsyncEngine). Either way the
test reads the engine only through the engine's own calls (`srv.state()`), never its objects.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Iterator, Optional

import pytest

pytest.importorskip("fastapi", reason="the server tests need the `server` extra (fastapi, uvicorn)")
import uvicorn  # noqa: E402

from moe_infer.assets import default_model_path  # noqa: E402
from moe_infer.engine.async_engine import AsyncEngine  # noqa: E402
from moe_infer.engine.core_client import ProcessEngine  # noqa: E402
from moe_infer.engine.introspection import EngineState  # noqa: E402
from moe_infer.engine.llm import build_config  # noqa: E402
from moe_infer.engine.llm_engine import LLMEngine  # noqa: E402
from moe_infer.server.app import build_app  # noqa: E402
from moe_infer.server.config import ServeConfig  # noqa: E402

MODEL = "tiny_moe"
_ENGINES = {}


def engine_kwargs(**overrides) -> dict:
    kw = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=128, max_num_seqs=8,
              max_num_batched_tokens=512)
    kw.update(overrides)
    return kw


def tiny_engine(**overrides) -> LLMEngine:
    """An LLMEngine over the shipped tiny MoE on CPU (cached per process for the same arguments)."""
    kw = engine_kwargs(**overrides)
    key = tuple(sorted(kw.items()))
    if key not in _ENGINES:
        _ENGINES[key] = LLMEngine(build_config(model=default_model_path(), **kw), default_model_path())
    return _ENGINES[key]


class LiveServer:
    def __init__(self, serve: ServeConfig, **overrides) -> None:
        max_requests = engine_kwargs(**overrides)["max_num_seqs"] + serve.max_queued_requests
        if serve.engine_loop == "process":
            self.engine = ProcessEngine(build_config(model=default_model_path(), **engine_kwargs(**overrides)),
                                        default_model_path(), max_requests=max_requests)
        else:
            self.engine = AsyncEngine(tiny_engine(**overrides), max_requests=max_requests)
        self.app = build_app(self.engine, serve, default_model_path())
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=serve.drain_timeout_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.port: Optional[int] = None

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        if isinstance(self.engine, ProcessEngine):
            self.engine.close()  # after the app's shutdown the core has stopped: this joins it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def utility(self, name: str, timeout: float = 30.0):
        """engine.utility(name) on the server's event loop, from the test's thread."""
        return asyncio.run_coroutine_threadsafe(self.engine.utility(name), self.engine.loop).result(timeout)

    def state(self) -> EngineState:
        return self.utility("state")

    def blocks_used(self) -> int:
        st = self.state()
        return st.num_kv_blocks - st.num_free_kv_blocks

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no request is in flight and every KV block is free (fails the test otherwise)."""
        deadline = time.monotonic() + timeout
        while self.engine.num_requests or not (st := self.state()).is_idle:
            if time.monotonic() > deadline:
                st = self.state()
                raise AssertionError(f"not idle after {timeout} s: {self.engine.num_requests} open streams, {st}")
            time.sleep(0.02)


@contextlib.contextmanager
def live_server(serve: Optional[dict] = None, **overrides) -> Iterator[LiveServer]:
    srv = LiveServer(ServeConfig(**(serve or {})), **overrides).start()
    try:
        yield srv
    finally:
        srv.stop()
