"""The engine core process: an `LLMEngine` in a process of its own, driven over two pipes.

Why a process: in one process the HTTP side (request parsing, JSON, one server-sent event per token)
and the engine loop (scheduling, kernel launches, output handling) share one GIL; with async scheduling
the engine's host work must keep ahead of the GPU, and every millisecond the HTTP side holds the GIL
leaves the GPU idle. vLLM's v1 engine core runs apart from its API server for the same reason.

`run_engine_core` is the process's target (started by `ProcessEngine`, moe_infer/engine/core_client.py).
It builds the engine, answers `("ready", CoreInfo)` (or `("start_failed", why)`), then loops: between two
steps it takes every queued command, then runs `LLMEngine.step()` while requests are unfinished and
sends the step's outputs as deltas (moe_infer/engine/output_delta.py). The core does not detokenize: its
deltas carry token ids, and the client turns them into text and checks stop strings
(moe_infer/engine/detok_assembler.py), as vLLM's front end does. Detokenizing every running request
each step took about 13 % of the core's step time at saturation on an H100 (py-spy, 2026-11-24), host
time that async scheduling cannot hide once the host is the bound. A stop string found by the client ends
its sample with a "stop" command; the core may have run a step or two of it meanwhile, whose tokens
the client drops. Messages are pickled tuples:

    client -> core   ("add", request_id, prompt, SamplingParams)      {"prompt_token_ids", "prompt"} as a rule
                     ("abort", [request_id, ...])
                     ("stop", request_id, sample_index, stop_string)
                     ("utility", call_id, name)                 moe_infer/engine/introspection.py
                     ("shutdown",)
    core -> client   ("ready", CoreInfo) | ("start_failed", message)
                     ("outputs", [OutputDelta as a tuple, ...])  one message per step
                     ("failed", [request_id, ...], message)     failed outside a step
                     ("result", call_id, value, error_message)
                     ("stopped", message or None)               the last message

A request that fails alone (a bad prompt, a failing forward) finishes with finish_reason "error" as in
the offline engine; an error outside a step fails the requests in flight and the loop goes on. The core
stops on "shutdown" or when the client's pipe closes (its process died): it never outlives the server.
Signals: SIGINT and SIGTERM are ignored here (a terminal's Ctrl-C reaches the whole process group); the
server drains, then sends "shutdown". The core sends on its own thread (see `DirectSender`).
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import List

from moe_infer.engine.output_delta import DeltaEncoder
from moe_infer.engine.prompt_limits import PromptLimits

logger = logging.getLogger(__name__)


@dataclass
class CoreInfo:
    """What the client needs of the engine it did not build."""

    pid: int
    max_model_len: int
    limits: PromptLimits


class DirectSender:
    """conn.send on the engine's own thread. A sending thread here would take the GIL from the engine loop
    at every step: on the H100, 512 requests at saturation through ProcessEngine measured 18.4k tok/s with a
    sending thread, 22.9k sending directly (same machine, 2026-11-24). The client reads in a thread of its
    own and the pipe holds ~1 MiB (`widen_pipe`), so a send does not wait in practice."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, EOFError):  # the client is gone: the loop sees it on its next read
            pass

    def close(self, timeout_s: float = 0.0) -> None:
        pass


def widen_pipe(conn: Connection, size: int = 1 << 20) -> None:
    """Linux: the pipe's buffer to `size` bytes (64 KiB by default), where the system allows it."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, size)
    except (ImportError, AttributeError, OSError):
        pass


def run_engine_core(cfg, model_path: str, commands: Connection, results: Connection, log_level: int) -> None:
    """The engine core process's main (its arguments are pickled: spawn)."""

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    widen_pipe(results)
    sender = DirectSender(results)
    try:
        from moe_infer.engine.llm_engine import LLMEngine

        engine = LLMEngine(cfg, model_path, detokenize=False)  # the server's process detokenizes
    except BaseException as err:  # a bad config, an unreadable checkpoint, no memory: the server says why
        logger.exception("the engine did not start")
        sender.send(("start_failed", f"{type(err).__name__}: {err}"))
        sender.close()
        return
    if engine.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        leave_a_core_to_the_server()
    sender.send(("ready", CoreInfo(os.getpid(), engine.max_model_len, engine.limits)))
    message = None
    try:
        EngineCore(engine, commands, sender).serve()
    except BaseException as err:  # the loop itself died (e.g. a collective timed out)
        logger.exception("the engine loop stopped")
        message = f"the engine loop stopped: {type(err).__name__}: {err}"
    finally:
        sender.send(("stopped", message))
        sender.close()
        engine.parallel.shutdown()


def leave_a_core_to_the_server() -> None:
    """An engine on the CPU: torch's intra-op threads take every core by default, and the server's process
    needs one too. Oversubscribed OpenMP threads spin against it and steps slow down many times over (the
    soak test on 2 cores: 12 s of load took 31 s to over 120 s to serve, against 12.3 s with one thread)."""
    import torch

    threads = max(1, torch.get_num_threads() - 1)
    logger.info("CPU engine: %d intra-op threads, one core left to the server (set OMP_NUM_THREADS to choose)",
                threads)
    torch.set_num_threads(threads)


class EngineCore:
    def __init__(self, engine, commands: Connection, sender: DirectSender) -> None:
        self.engine, self.commands, self.sender = engine, commands, sender
        self.encoder = DeltaEncoder()

    def serve(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if not busy or self.commands.poll():  # idle: block until a command comes
                if not self._run_commands(self._receive(block=not busy)):
                    break
            if engine.has_unfinished_requests():
                self._step()
        for rid in list(engine.requests):
            engine.abort_request(rid)
        engine.executor.finish([])

    def _receive(self, block: bool) -> List[tuple]:
        msgs = []
        try:
            if block:
                msgs.append(self.commands.recv())
            while self.commands.poll():
                msgs.append(self.commands.recv())
        except (EOFError, OSError):  # the client's process is gone
            msgs.append(("shutdown",))
        return msgs

    def _run_commands(self, msgs: List[tuple]) -> bool:
        """Runs them; False once "shutdown" came."""
        for msg in msgs:
            kind = msg[0]
            if kind == "add":
                _, rid, prompt, params = msg
                try:
                    self.engine.add_request(prompt, params, rid)
                except Exception as err:  # e.g. a duplicate id: this request fails, nothing else
                    self.sender.send(("failed", [rid], f"{type(err).__name__}: {err}"))
            elif kind == "abort":
                for rid in msg[1]:
                    self.engine.abort_request(rid)
            elif kind == "stop":  # the client found sample msg[2]'s stop string msg[3]
                self.engine.stop_sample(msg[1], msg[2], msg[3])
            elif kind == "utility":
                self._utility(msg[1], msg[2])
            elif kind == "shutdown":
                return False
            else:
                logger.error("unknown command %r", kind)
        return True

    def _utility(self, call_id: int, name: str) -> None:
        from moe_infer.engine.introspection import run_utility

        try:
            self.sender.send(("result", call_id, run_utility(self.engine, name), None))
        except Exception as err:
            self.sender.send(("result", call_id, None, f"{type(err).__name__}: {err}"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step(encoder=self.encoder)
        except Exception as err:  # not a forward failure (the engine handles those): fail what is in flight
            logger.exception("engine step failed outside the forward; failing the requests in flight")
            failed = list(self.engine.requests)
            for rid in failed:
                self.engine.abort_request(rid)  # frees their blocks
                self.encoder.forget(rid)
            self.sender.send(("failed", failed, f"{type(err).__name__}: {err}"))
            return
        if outputs:
            self.sender.send(("outputs", outputs))
