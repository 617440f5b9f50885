"""Several API server processes in front of one engine core: `serve.api_server_count=N` (vLLM's
`--api-server-count`).

    moe-infer serve model=hf model.path=/ckpt/Qwen3-30B-A3B serve.api_server_count=4

Why: at saturation a single server process is the bound, not the engine. Every streamed token costs it
an event written to a socket, a detokenizer step and an output built; on an H100 with 2048 requests at
once its process was at 96 % of one core while the engine core had time to spare (measurement notes in
docs/serving.md). N processes split that work.

How: this process (the launcher) starts the engine core with one pair of pipes per server
(`CoreProcess`, moe_infer/engine/core_spawn.py), waits until it is ready (a start failure is reported
here, as with one server), takes the port, and spawns N server processes. Each serves the whole API on
that port (on Linux each listens on a socket of its own with SO_REUSEPORT, and the kernel spreads new
connections over them) as a client of the core; the core routes every request's outputs back to the
process that added it. What the processes share:

- the request limit (`max_num_seqs + max_queued_requests`): one counter in shared memory, so the 429s
  come where they would with one process (`RequestSlots`);
- Prometheus metrics: prometheus-client's multiprocess mode (a `PROMETHEUS_MULTIPROC_DIR`, made here
  unless set), so /metrics from any process counts every process's requests;
- nothing else: each loads the tokenizer and detokenizes its own streams.

Lifecycle: SIGINT or SIGTERM to the launcher is passed to every server once (they are in a process
group of their own, so a terminal's Ctrl-C does not reach them twice); each drains for
`serve.drain_timeout_s` and leaves the core, and the core stops when the last one left. If the core or a
server exits on its own, the launcher stops the others and exits non-zero: an orchestrator restarts the
whole server. A server whose launcher is killed drains and exits too.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
from multiprocessing.connection import wait
from typing import List, Optional, Tuple

from moe_infer.config import EngineConfig
from moe_infer.server.config import ServeConfig

logger = logging.getLogger(__name__)
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
BACKLOG = 4096


def serve_many(engine_cfg: EngineConfig, serve_cfg: ServeConfig, path: str, max_requests: int) -> int:
    """Runs until shut down; the exit code (0 after a clean shutdown)."""
    from moe_infer.engine.core_spawn import CoreProcess

    own_dir = METRICS_DIR_ENV not in os.environ
    if own_dir:  # set before any server process starts: prometheus-client reads it at import
        os.environ[METRICS_DIR_ENV] = tempfile.mkdtemp(prefix="moe-infer-metrics-")
    elif os.listdir(os.environ[METRICS_DIR_ENV]):
        logger.warning("%s=%s holds files of an earlier run: /metrics will count them too (empty it first)",
                       METRICS_DIR_ENV, os.environ[METRICS_DIR_ENV])
    count = serve_cfg.api_server_count
    core = CoreProcess(engine_cfg, path, num_clients=count)
    try:
        info = core.wait_ready()
        reserved, shared = reserve_port(serve_cfg.host, serve_cfg.port)
        port = reserved.getsockname()[1]
        ctx = mp.get_context("spawn")
        slots = ctx.Value("q", 0)  # requests in flight, over every server process
        servers = [ctx.Process(target=run_api_server, name=f"moe-infer-api-server-{i}",
                               args=(i, core.endpoints[i], info, slots, max_requests, serve_cfg, path, port,
                                     reserved if shared else None, logging.getLogger().getEffectiveLevel()))
                   for i in range(count)]
        for proc in servers:
            proc.start()
        core.close_endpoints()
        logger.info("%d API server processes on http://%s:%d, engine core pid %d", count, serve_cfg.host, port,
                    core.proc.pid)
        try:
            return _supervise(core, servers, serve_cfg.drain_timeout_s)
        finally:
            reserved.close()
    finally:
        core.close_endpoints()  # idempotent; if no server started (the port was taken), the core sees EOF
        core.join(timeout_s=60.0)
        if own_dir:
            shutil.rmtree(os.environ.pop(METRICS_DIR_ENV), ignore_errors=True)


def reserve_port(host: str, port: int) -> Tuple[socket.socket, bool]:
    """(a socket bound to host:port, whether the servers share it). Linux: SO_REUSEPORT, and the socket is not
    listening: it only holds the port (port 0: picks it) while each server listens on a socket of its own,
    and the kernel spreads new connections over those evenly (a shared listening socket hands a burst of
    connections to whichever process accepts first). Elsewhere: one listening socket that every server
    accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shared = not hasattr(socket, "SO_REUSEPORT")
    try:
        if shared:
            sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
            sock.set_inheritable(True)
            return sock, True
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        return sock, False
    except OSError as err:
        raise SystemExit(f"cannot listen on {host}:{port}: {err}") from None


def listen_socket(host: str, port: int) -> socket.socket:
    """A server process's own listening socket on the launcher's port (SO_REUSEPORT)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock


def _supervise(core, servers: List[mp.Process], drain_timeout_s: float) -> int:
    stopping = threading.Event()
    exit_code = 0

    def stop_servers(*_) -> None:
        if stopping.is_set():
            return
        stopping.set()
        for proc in servers:
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGTERM)  # each drains, then leaves the core

    previous = {sig: signal.signal(sig, stop_servers) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(proc.exitcode is None for proc in servers):
            wait([proc.sentinel for proc in servers if proc.exitcode is None] + [core.proc.sentinel], timeout=1.0)
            if stopping.is_set():
                continue
            gone = [f"API server {i} (exit code {proc.exitcode})" for i, proc in enumerate(servers)
                    if proc.exitcode is not None]
            if core.proc.exitcode is not None:
                gone.insert(0, f"the engine core (exit code {core.proc.exitcode})")
            if gone:
                logger.error("%s stopped on its own: stopping the server", ", ".join(gone))
                exit_code = 1
                stop_servers()
        for proc in servers:
            proc.join(drain_timeout_s + 30.0)
            if proc.exitcode is None:
                logger.error("%s did not stop: killing it", proc.name)
                proc.kill()
                proc.join(10)
            elif proc.exitcode != 0 and exit_code == 0:
                logger.error("%s exited with code %s", proc.name, proc.exitcode)
                exit_code = 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code


def run_api_server(index: int, endpoint, info, slots_value, max_requests: int, serve_cfg: ServeConfig, path: str,
                   port: int, shared: Optional[socket.socket], log_level: int) -> None:
    """One server process's main (arguments pickled: spawn); shared: the listening socket, where the servers
    do not listen on sockets of their own (see `reserve_port`)."""
    os.setpgrp()  # signals come from the launcher, once
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [api server {index}] %(name)s: %(message)s")
    _drain_when_orphaned()
    from moe_infer.engine.core_client import ProcessEngine
    from moe_infer.engine.request_streams import RequestSlots
    from moe_infer.server.app import build_app
    from moe_infer.server.uvicorn_run import run_uvicorn

    sock = shared if shared is not None else listen_socket(serve_cfg.host, port)
    engine = ProcessEngine.attached(endpoint, info, path, RequestSlots(max_requests, shared=slots_value))
    try:
        run_uvicorn(build_app(engine, serve_cfg, path), serve_cfg, sockets=[sock])
    finally:
        engine.close()


def _drain_when_orphaned() -> None:
    """The launcher died (SIGKILL, out of memory): drain as if it had sent SIGTERM."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        logger.error("the launcher process is gone: shutting down")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="moe-infer-parent-watch", daemon=True).start()
