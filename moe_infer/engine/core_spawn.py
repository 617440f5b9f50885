"""CoreProcess: starts the engine core process (moe_infer/engine/core_proc.py) and holds its clients' pipe ends.

    core = CoreProcess(cfg, model_path, num_clients=2)   # spawns the core; it builds its engine meanwhile
    info = core.wait_ready(timeout_s=None)               # CoreInfo, or EngineStartError saying why not
    core.endpoints[i]                                    # client i's (commands, results) ends

`ProcessEngine` (moe_infer/engine/core_client.py) starts one with one client and drives it itself. With
several API server processes (`serve.api_server_count`, moe_infer/server/multi.py) the launcher starts it,
waits until it is ready, and hands one endpoint to each server process it spawns; it then closes its own
copies of the ends, so that the core's exit reaches every server as an EOF.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import List, NamedTuple, Optional

from moe_infer.engine.core_proc import CoreInfo, core_device_type, run_engine_core
from moe_infer import host_threads

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine core process could not build its engine (the message says why)."""


class CoreEndpoint(NamedTuple):
    """One client's ends of its two pipes to the core."""

    commands: Connection  # client -> core (write end)
    results: Connection  # core -> client (read end)


class CoreProcess:
    def __init__(self, cfg, model_path: str, num_clients: int = 1) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        ctx = mp.get_context("spawn")  # CUDA cannot be forked; the servers' processes never touch it
        core_ends, self.endpoints = [], []
        for _ in range(num_clients):
            cmd_read, cmd_write = ctx.Pipe(duplex=False)
            res_read, res_write = ctx.Pipe(duplex=False)
            core_ends.append((cmd_read, res_write))
            self.endpoints.append(CoreEndpoint(cmd_write, res_read))
        self.proc = ctx.Process(target=run_engine_core, name="moe-infer-engine-core",
                                args=(cfg, model_path, core_ends, logging.getLogger().getEffectiveLevel()))
        # read when the core loads torch; its pool leaves a core to each API server process
        with host_threads.spawn_env(cfg.offload, core_device_type(cfg), reserved_cores=num_clients) as added:
            self.proc.start()
        if added:
            logger.info("engine core started with %s: the host computes expert misses (docs/offload.md)",
                        " ".join(f"{k}={v}" for k, v in added.items()))
        for cmd_read, res_write in core_ends:
            cmd_read.close()
            res_write.close()  # the core holds the only write ends: its exit is an EOF for every client

    def wait_ready(self, timeout_s: Optional[float] = None) -> CoreInfo:
        """The core's CoreInfo once its engine is built (read from every endpoint: each gets the message)."""
        infos: List[CoreInfo] = [self._first_message(end.results, timeout_s) for end in self.endpoints]
        return infos[0]

    def _first_message(self, results: Connection, timeout_s: Optional[float]) -> CoreInfo:
        waited = 0.0
        while not results.poll(1.0):
            waited += 1.0
            if not self.proc.is_alive():
                raise self._exited_early()
            if timeout_s is not None and waited >= timeout_s:
                self.proc.kill()
                raise EngineStartError(f"the engine core was not ready after {timeout_s:.0f} s")
        try:
            msg = results.recv()
        except EOFError:
            self.proc.join(10)
            raise self._exited_early() from None
        if msg[0] == "start_failed":
            self.proc.join(30)
            raise EngineStartError(f"the engine did not start: {msg[1]}")
        return msg[1]

    def _exited_early(self) -> EngineStartError:
        return EngineStartError(f"the engine core process exited with code {self.proc.exitcode} before it was "
                                "ready (see its log above)")

    def close_endpoints(self) -> None:
        """This process's copies of the client ends (after handing them to the server processes)."""
        for end in self.endpoints:
            end.commands.close()
            end.results.close()

    def join(self, timeout_s: float) -> None:
        """Wait for the core to exit (it does once every client left); kill it past timeout_s."""
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            logger.error("the engine core did not stop in %.0f s: killing it", timeout_s)
            self.proc.kill()
            self.proc.join(10)
