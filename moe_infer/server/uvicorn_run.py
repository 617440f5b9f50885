"""Running the app under uvicorn until SIGINT/SIGTERM and a drain: one function, shared by the single server
(server/launch.py) and the multi-process front ends (server/multi.py)."""
from __future__ import annotations

import signal

from moe_infer.server.config import ServeConfig


def run_uvicorn(app, serve_cfg: ServeConfig, sockets=None) -> None:
    """uvicorn on serve.host/port, or on sockets bound already (moe_infer/server/multi.py), until SIGINT/SIGTERM
    and a drain of up to serve.drain_timeout_s."""
    import uvicorn

    config = uvicorn.Config(app, host=serve_cfg.host, port=serve_cfg.port, log_level=serve_cfg.log_level,
                            access_log=serve_cfg.access_log, timeout_graceful_shutdown=serve_cfg.drain_timeout_s,
                            backlog=4096)
    # uvicorn drains on SIGINT/SIGTERM, then raises the signal again; with these handlers in place that
    # last signal is a no-op, so the ranks are released and the process exits 0 after a clean drain
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
