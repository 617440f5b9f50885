"""ProcessEngine: the server's engine, a `StreamingEngine` whose `LLMEngine` runs in a process of its own.

    engine = ProcessEngine(cfg, model_path, max_requests=512)   # spawns the core, waits until it is ready
    await engine.start()                                         # inside the server's event loop
    async for out in engine.generate(prompt, params): ...
    await engine.shutdown(drain_timeout_s=10)

Why, the core's loop and its messages: moe_infer/engine/core_proc.py. This side keeps what HTTP needs
without asking the core: the tokenizer (text prompts are tokenized here, as the server does anyway), the
prompt limits (400s before a request leaves), and per request a `DetokenizingAssembler` that turns the
core's deltas (token ids) back into the cumulative `RequestOutput`s every stream reader gets: text, stop
strings and logprobs' decoded tokens are made here, not in the core. A reader thread receives; the
event loop applies each step's deltas in one callback. Sends go through a thread too, so a long prompt
never blocks the event loop on a full pipe.

If the core process dies (a crash, an out-of-memory kill), every open stream fails with `EngineClosed`
and the server's /health answers 503; nothing hangs. Under torchrun the core joins the mesh as the
driver rank (it inherits the launcher's environment); the other ranks run its steps as before.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from multiprocessing.connection import Connection
from typing import Callable, Dict, List, Optional, Sequence

from moe_infer.engine.core_proc import CoreInfo
from moe_infer.engine.core_spawn import CoreEndpoint, CoreProcess, EngineStartError  # noqa: F401 (re-export)
from moe_infer.engine.detok_assembler import DetokenizingAssembler
from moe_infer.engine.encode import encode
from moe_infer.engine.output_delta import OutputAssembler
from moe_infer.engine.outputs import RequestOutput
from moe_infer.engine.request_streams import EngineClosed, RequestFailed, RequestSlots, StreamingEngine
from moe_infer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PipeSender:
    """conn.send from a thread of its own, in order: a long prompt never blocks the event loop on a full pipe;
    `close()` sends what is queued, then stops."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        self._queue.put(msg)

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            msg = self._queue.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, EOFError):  # the other side is gone: nothing left to tell it
                return


class ProcessEngine(StreamingEngine):
    _thread_name = "moe-infer-core-reader"

    def __init__(self, cfg, model_path: str, max_requests: int = 1024,
                 on_finished: Optional[List[Callable[[RequestOutput], None]]] = None,
                 start_timeout_s: Optional[float] = None) -> None:
        """Spawns the core (one client: this engine) and waits until it is ready."""
        from moe_infer.engine.llm_engine import load_tokenizer

        core = CoreProcess(cfg, model_path)
        tokenizer = load_tokenizer(model_path)  # while the core builds its engine
        info = core.wait_ready(start_timeout_s)
        self._setup(core.endpoints[0], info, tokenizer, RequestSlots(max_requests), on_finished)
        self._core: Optional[CoreProcess] = core

    @classmethod
    def attached(cls, endpoint: CoreEndpoint, info: CoreInfo, model_path: str, slots: RequestSlots,
                 on_finished: Optional[List[Callable[[RequestOutput], None]]] = None) -> "ProcessEngine":
        """A client of a core that another process started and found ready (CoreProcess, one endpoint per
        API server process; slots: the request limit the servers share)."""
        from moe_infer.engine.llm_engine import load_tokenizer

        engine = cls.__new__(cls)
        engine._setup(endpoint, info, load_tokenizer(model_path), slots, on_finished)
        engine._core = None
        return engine

    def _setup(self, endpoint: CoreEndpoint, info: CoreInfo, tokenizer, slots: RequestSlots, on_finished) -> None:
        StreamingEngine.__init__(self, slots.limit, on_finished, slots=slots)
        self._results = endpoint.results
        self._sender = PipeSender(endpoint.commands, "moe-infer-core-commands")
        self.tokenizer = tokenizer
        self.core_pid, self.max_model_len, self.limits = info.pid, info.max_model_len, info.limits
        self._assemblers: Dict[str, object] = {}  # request id -> its assembler
        self._calls: Dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stopped = threading.Event()
        self.stop_message: Optional[str] = None
        self._shutdown_sent = False

    # ------------------------------------------------------------------ lifecycle
    def _alive(self) -> bool:
        return self._thread is not None and not self._stopped.is_set()

    async def _stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self, timeout_s: float = 60.0) -> None:
        """Leave the core (synchronous; also what a server that never started its loop calls): a core this
        engine started stops, and close waits for it; a shared one goes on for its other clients."""
        core_alive = self._core.proc.is_alive() if self._core is not None else True
        if core_alive and not self._stopped.is_set() and not self._shutdown_sent:
            self._shutdown_sent = True
            self._sender.send(("shutdown",))
        if self._core is not None:
            self._core.join(timeout_s)
        elif self._thread is not None:
            self._stopped.wait(timeout_s)  # the core's ("stopped", None) to this client
        self._sender.close(timeout_s=1.0)
        if self._thread is not None:
            self._thread.join(5.0)

    # ------------------------------------------------------------------ commands
    def _submit(self, request_id: str, prompt, params: SamplingParams) -> None:
        text, ids, sent = self._prompt(prompt)
        if self.tokenizer is not None:  # the core sends token ids: text and stop strings are made here
            self._assemblers[request_id] = DetokenizingAssembler(request_id, text, ids, params, self.tokenizer,
                                                                 self._stop_sample)
        else:
            self._assemblers[request_id] = OutputAssembler(request_id, text, ids, params.n, params.logprobs is not None)
        self._sender.send(("add", request_id, sent, params))

    def _stop_sample(self, request_id: str, index: int, stop: str) -> None:
        self._sender.send(("stop", request_id, index, stop))

    def _prompt(self, prompt):
        """(text, token ids, what the core gets) of a prompt: text is tokenized here; the core checks the
        ids as the offline engine does, and answers a malformed prompt with its error."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            ids = list(ids) if isinstance(ids, (list, tuple)) else []
            return prompt.get("prompt"), ids, prompt  # not decoded to text, as the offline engine (llm_engine.py)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str) and self.tokenizer is not None:
            ids = encode(self.tokenizer, text)
            return text, ids, {"prompt_token_ids": ids, "prompt": text}
        return (text if isinstance(text, str) else None), [], prompt

    def _abort(self, request_ids: Sequence[str]) -> None:
        self._sender.send(("abort", list(request_ids)))

    async def utility(self, name: str):
        if not self._alive():
            raise EngineClosed("the engine loop is not running")
        call_id = next(self._call_ids)
        fut = self._calls[call_id] = self._loop.create_future()
        self._sender.send(("utility", call_id, name))
        return await fut

    # ------------------------------------------------------------------ the reader thread
    def _thread_main(self) -> None:
        """The reader: the core's messages, handed to the event loop."""
        while True:
            try:
                msg = self._results.recv()
            except (EOFError, OSError):
                code = self._core.proc.exitcode if self._core is not None else None
                msg = ("stopped", "the engine core process exited" + (f" (code {code})" if code is not None else ""))
            if msg[0] == "stopped":
                self._stopped.set()
                self._loop.call_soon_threadsafe(self._on_stopped, msg[1])
                return
            self._loop.call_soon_threadsafe(self._on_message, msg)

    # ------------------------------------------------------------------ the event loop side
    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outputs":
            self._dispatch([self._assemble(d) for d in msg[1] if d[0] in self._assemblers])
        elif kind == "failed":
            for rid in msg[1]:
                self._assemblers.pop(rid, None)
            self._fail(msg[1], RequestFailed(msg[2]))
        elif kind == "result":
            fut = self._calls.pop(msg[1], None)
            if fut is not None and not fut.cancelled():
                if msg[3] is None:
                    fut.set_result(msg[2])
                else:
                    fut.set_exception(RuntimeError(msg[3]))

    def _assemble(self, wire: tuple) -> RequestOutput:
        """A delta (an OutputDelta as a plain tuple) applied to its request's assembler."""
        out = self._assemblers[wire[0]].apply(wire)
        if out.finished:
            del self._assemblers[wire[0]]
        return out

    def _on_stopped(self, message: Optional[str]) -> None:
        self.stop_message = message
        if message is not None or self._streams:
            logger.error("the engine core stopped: %s", message or "with requests in flight")
        self._closing = True
        error = EngineClosed(message or "the engine core stopped")
        self._fail(None, error)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()
        self._assemblers.clear()
