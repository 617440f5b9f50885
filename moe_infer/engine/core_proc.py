"""The engine core process: an `LLMEngine` in a process of its own, driven over two pipes per client.

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
the client drops. A client is one API server process: with `serve.api_server_count` > 1 (vLLM's
`--api-server-count`) several of them share the core, each over its own pair of pipes, and each request's
messages go to the client that added it. Messages are pickled tuples:

    client -> core   ("add", request_id, prompt, SamplingParams)      {"prompt_token_ids", "prompt"} as a rule
                     ("abort", [request_id, ...])
                     ("stop", request_id, sample_index, stop_string)
                     ("utility", call_id, name)                 moe_infer/engine/introspection.py
                     ("shutdown",)
    core -> client   ("ready", CoreInfo) | ("start_failed", message)
                     ("outputs", [TokenDelta or OutputDelta as a tuple, ...])  one message per step
                     ("failed", [request_id, ...], message)     failed outside a step
                     ("result", call_id, value, error_message)
                     ("stopped", message or None)               the last message (to a client that
                                                                said "shutdown": None, the others go on)

A request that fails alone (a bad prompt, a failing forward) finishes with finish_reason "error" as in
the offline engine; an error outside a step fails the requests in flight and the loop goes on. A client's
"shutdown", or its pipe closing (its process died), aborts that client's requests; the core stops when
no client is left: it never outlives the server.
Signals: SIGINT and SIGTERM are ignored here (a terminal's Ctrl-C reaches the whole process group); the
server drains, then sends "shutdown". The core sends on its own thread (see `DirectSender`).
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Dict, List, Sequence, Tuple

from moe_infer.engine.output_delta import DeltaEncoder
from moe_infer.engine.prompt_limits import PromptLimits
from moe_infer import host_threads

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


def run_engine_core(cfg, model_path: str, clients: Sequence[Tuple[Connection, Connection]], log_level: int) -> None:
    """The engine core process's main (its arguments are pickled: spawn). clients: one (commands, results)
    pipe pair per API server process (`serve.api_server_count`)."""

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    senders = []
    for _, results in clients:
        widen_pipe(results)
        senders.append(DirectSender(results))
    try:
        # before the engine's first parallel region (the offload cost model times the host's experts at start-up):
        # a pool made smaller later may keep its extra threads spinning under OMP_WAIT_POLICY=ACTIVE
        if needs_cores_left(core_device_type(cfg), os.environ):
            leave_cores_to_the_servers(len(clients))
        from moe_infer.engine.llm_engine import LLMEngine

        engine = LLMEngine(cfg, model_path, detokenize=False)  # the server's process detokenizes
    except BaseException as err:  # a bad config, an unreadable checkpoint, no memory: the server says why
        logger.exception("the engine did not start")
        for sender in senders:
            sender.send(("start_failed", f"{type(err).__name__}: {err}"))
        return
    for sender in senders:
        sender.send(("ready", CoreInfo(os.getpid(), engine.max_model_len, engine.limits)))
    message = None
    core = EngineCore(engine, [commands for commands, _ in clients], senders)
    try:
        core.serve()
    except BaseException as err:  # the loop itself died (e.g. a collective timed out)
        logger.exception("the engine loop stopped")
        message = f"the engine loop stopped: {type(err).__name__}: {err}"
    finally:
        for client in core.live:  # those that did not leave ("stopped" went to each as it left)
            senders[client].send(("stopped", message))
        engine.parallel.shutdown()


def core_device_type(cfg) -> str:
    """'cuda' or 'cpu': where the core's engine will run (model.device, auto: CUDA where there is one)."""
    import torch

    return host_threads.device_type_of(cfg.model.device, torch.cuda.is_available())


def needs_cores_left(device_type: str, environ) -> bool:
    """Whether the engine's intra-op threads would spin against the server processes' cores: a CPU engine, or
    a GPU engine whose offload host threads spin (OMP_WAIT_POLICY=ACTIVE, moe_infer/host_threads.py); never
    when the user chose the thread count (OMP_NUM_THREADS)."""
    return "OMP_NUM_THREADS" not in environ and (device_type == "cpu" or host_threads.spins(environ))


def leave_cores_to_the_servers(num_servers: int) -> None:
    """An engine on the CPU (or spinning offload host threads): torch's intra-op threads take every core by
    default, and each server process needs one too. Oversubscribed OpenMP threads spin against them and steps
    slow down many times over (the soak test on 2 cores: 12 s of load took 31 s to over 120 s to serve, against
    12.3 s with one thread). Call it before the process's first parallel region: a libgomp pool made smaller
    after one may keep its extra threads spinning under OMP_WAIT_POLICY=ACTIVE (benchmarks/trials/omp_pool_shrink.py:
    a pool of 2 made 1 did, torch 2.13 on 2 cores; a pool of 16 made 15 did not, torch 2.11 on an H200 host)."""
    import torch

    threads = max(1, torch.get_num_threads() - num_servers)
    logger.info("engine core: %d intra-op threads, %d core(s) left to the server (set OMP_NUM_THREADS to choose)",
                threads, num_servers)
    torch.set_num_threads(threads)


class EngineCore:
    """The loop over one engine and its clients (one per API server process). Each request belongs to the
    client that added it: its deltas, failures and utility results go to that client only. A client that
    says "shutdown" (or whose pipe closes) has its requests aborted; the loop ends when no client is left."""

    def __init__(self, engine, commands: Sequence[Connection], senders: Sequence[DirectSender]) -> None:
        self.engine, self.commands, self.senders = engine, list(commands), list(senders)
        self.encoder = DeltaEncoder()
        self.owner: Dict[str, int] = {}  # request id -> its client (with more than one client)
        self.live = dict(enumerate(self.commands))  # client -> commands, of clients still connected

    def serve(self) -> None:
        engine = self.engine
        index = {id(conn): i for i, conn in self.live.items()}
        while self.live:
            busy = engine.has_unfinished_requests()
            for conn in wait(list(self.live.values()), timeout=0 if busy else None):  # idle: block for one
                client = index[id(conn)]
                self._run_commands(client, self._receive(conn))
            if engine.has_unfinished_requests():
                self._step()
        for rid in list(engine.requests):
            engine.abort_request(rid)
        engine.executor.finish([])

    @staticmethod
    def _receive(conn: Connection) -> List[tuple]:
        msgs = []
        try:
            msgs.append(conn.recv())
            while conn.poll():
                msgs.append(conn.recv())
        except (EOFError, OSError):  # the client's process is gone
            msgs.append(("shutdown",))
        return msgs

    def _run_commands(self, client: int, msgs: List[tuple]) -> None:
        for msg in msgs:
            kind = msg[0]
            if kind == "add":
                _, rid, prompt, params = msg
                if rid in self.owner:  # another client's request: the engine would take it for a duplicate
                    self.senders[client].send(("failed", [rid], f"ValueError: request id {rid!r} is in use"))
                    continue
                try:
                    self.engine.add_request(prompt, params, rid)
                except Exception as err:  # e.g. a duplicate id: this request fails, nothing else
                    self.senders[client].send(("failed", [rid], f"{type(err).__name__}: {err}"))
                    continue
                if len(self.senders) > 1:
                    self.owner[rid] = client
            elif kind == "abort":
                for rid in msg[1]:
                    if self.owner.get(rid, client) == client:
                        self.engine.abort_request(rid)
            elif kind == "stop":  # the client found sample msg[2]'s stop string msg[3]
                if self.owner.get(msg[1], client) == client:
                    self.engine.stop_sample(msg[1], msg[2], msg[3])
            elif kind == "utility":
                self._utility(client, msg[1], msg[2])
            elif kind == "shutdown":
                self._drop_client(client)
                return
            else:
                logger.error("unknown command %r", kind)

    def _drop_client(self, client: int) -> None:
        """The client is gone or done: its requests are aborted (their outputs go nowhere), and it gets its
        last message, ("stopped", None), while the loop goes on for the other clients."""
        self.live.pop(client, None)
        mine = [rid for rid in self.engine.requests if self.owner.get(rid, client) == client]
        for rid in mine:
            self.engine.abort_request(rid)
        self.senders[client].send(("stopped", None))

    def _utility(self, client: int, call_id: int, name: str) -> None:
        from moe_infer.engine.introspection import run_utility

        try:
            self.senders[client].send(("result", call_id, run_utility(self.engine, name), None))
        except Exception as err:
            self.senders[client].send(("result", call_id, None, f"{type(err).__name__}: {err}"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step(encoder=self.encoder)
        except Exception as err:  # not a forward failure (the engine handles those): fail what is in flight
            logger.exception("engine step failed outside the forward; failing the requests in flight")
            failed = list(self.engine.requests)
            for rid in failed:
                self.engine.abort_request(rid)  # frees their blocks
                self.encoder.forget(rid)
            why = f"{type(err).__name__}: {err}"
            self._send_per_client(failed, lambda rids: ("failed", rids, why))
            for rid in failed:
                self.owner.pop(rid, None)
            return
        if not outputs:
            return
        if len(self.senders) == 1:
            self.senders[0].send(("outputs", outputs))
            return
        self._send_per_client(outputs, lambda deltas: ("outputs", deltas), key=lambda d: d[0])
        for d in outputs:
            if len(d) == 5 and d[2]:  # a finished OutputDelta (a TokenDelta never is): its client's last one
                self.owner.pop(d[0], None)

    def _send_per_client(self, items: list, message, key=lambda rid: rid) -> None:
        """message(part) to each client, part: the items of its requests (key: an item's request id)."""
        if len(self.senders) == 1:
            self.senders[0].send(message(items))
            return
        per_client: Dict[int, list] = {}
        for item in items:
            client = self.owner.get(key(item))
            if client is not None and client in self.live:
                per_client.setdefault(client, []).append(item)
        for client, part in per_client.items():
            self.senders[client].send(message(part))
