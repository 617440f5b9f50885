"""StreamingEngine: one output stream per request for asyncio, over an engine loop that runs elsewhere.

Two engines derive from it and differ only in where the `LLMEngine` loop runs: `AsyncEngine` (a thread
of this process, moe_infer/engine/async_engine.py) and `ProcessEngine` (a process of its own,
moe_infer/engine/core_client.py). Both answer the same calls, so a server takes either:

    stream = engine.open(prompt, params, "req-1")   # EngineOverloaded / EngineClosed at once
    async for out in stream: ...                    # cumulative RequestOutputs until the finished one
    stream.close()                                  # before the end: aborts the request, frees its blocks
    engine.check_prompt(ids, params)                # why the engine would reject them (None: it would not)
    await engine.utility("stats")                   # (EngineStats, expert load), read between two steps
    await engine.shutdown(drain_timeout_s=10)       # finish or abort what is in flight, stop the loop

Streams: outputs are cumulative, so a request's stream keeps only the newest one (a slow reader skips to
it instead of queueing copies). A generator closed early (client disconnect, task cancelled) aborts its
request. A request whose engine step raises gets its error as an output (finish_reason "error"); an
error outside a step fails the requests in flight with `RequestFailed` and the loop goes on. Past
`max_requests` unfinished requests, `open` raises `EngineOverloaded` (the server answers 429); API server
processes that share one engine core share that limit (`RequestSlots`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence

from moe_infer.engine.outputs import RequestOutput
from moe_infer.engine.prompt_limits import PromptLimits
from moe_infer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """Too many unfinished requests: retry later."""


class EngineClosed(RuntimeError):
    """The engine is shutting down or its loop has stopped."""


class RequestFailed(RuntimeError):
    """The engine failed outside a step while this request was in flight."""


class RequestSlots:
    """How many requests may be in flight: `limit`, counted in this process, or across the API server
    processes that share one engine core (`shared`: a multiprocessing Value made by their launcher).
    `take(k)` admits k requests at once or none."""

    def __init__(self, limit: int, shared=None) -> None:
        if limit < 1:
            raise ValueError(f"max_requests must be >= 1, got {limit}")
        self.limit, self._shared, self._local = limit, shared, 0

    @property
    def in_use(self) -> int:
        return self._shared.value if self._shared is not None else self._local

    def take(self, count: int = 1) -> bool:
        if self._shared is None:
            if self._local + count > self.limit:
                return False
            self._local += count
            return True
        with self._shared.get_lock():
            if self._shared.value + count > self.limit:
                return False
            self._shared.value += count
            return True

    def give(self, count: int = 1) -> None:
        if self._shared is None:
            self._local -= count
            return
        with self._shared.get_lock():
            self._shared.value -= count


class _Stream:
    """The newest output of one request (outputs are cumulative), or the error that ended it."""

    def __init__(self) -> None:
        self.output: Optional[RequestOutput] = None
        self.error: Optional[BaseException] = None
        self.event = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self.output = out
        self.event.set()

    def fail(self, err: BaseException) -> None:
        self.error = err
        self.event.set()

    async def get(self) -> RequestOutput:
        await self.event.wait()
        self.event.clear()
        if self.error is not None:
            raise self.error
        out, self.output = self.output, None
        return out


class StreamingEngine(ABC):
    """The event-loop side shared by the engines; subclasses run the loop and set `tokenizer`,
    `max_model_len` and `limits`. `start()` runs `_thread_main` in a thread of this process: the engine
    loop itself (AsyncEngine) or the reader of the engine core's pipe (ProcessEngine)."""

    _thread_name = "moe-infer-engine"
    tokenizer: Any = None
    max_model_len: int = 0
    limits: Optional[PromptLimits] = None

    def __init__(self, max_requests: int = 1024,
                 on_finished: Optional[List[Callable[[RequestOutput], None]]] = None,
                 slots: Optional[RequestSlots] = None) -> None:
        self.slots = slots if slots is not None else RequestSlots(max_requests)
        self.max_requests = self.slots.limit
        self.on_finished = list(on_finished or [])
        self._streams: Dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._closing = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the event loop `start()` ran in
        self._thread: Optional[threading.Thread] = None

    @property
    def loop(self) -> Optional[asyncio.AbstractEventLoop]:
        return self._loop

    async def start(self) -> None:
        """Inside the event loop that will read the streams."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__}.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name=self._thread_name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what a subclass provides
    @abstractmethod
    def _thread_main(self) -> None:
        """The body of the thread `start()` runs."""

    @abstractmethod
    def _alive(self) -> bool:
        """The engine loop runs."""

    @abstractmethod
    def _submit(self, request_id: str, prompt, params: SamplingParams) -> None:
        """Hand the request to the engine loop (no await: see `open`)."""

    @abstractmethod
    def _abort(self, request_ids: Sequence[str]) -> None:
        """Abort these requests (their finished outputs follow)."""

    @abstractmethod
    async def _stop(self) -> None:
        """Stop the engine loop (every stream is closed by now) and wait for it."""

    @abstractmethod
    async def utility(self, name: str):
        """A read of the engine between two steps: "stats" -> (EngineStats, expert-load rows),
        "state" -> EngineState (moe_infer/engine/introspection.py)."""

    # ------------------------------------------------------------------ requests
    @property
    def is_running(self) -> bool:
        return self._alive() and not self._closing

    @property
    def num_requests(self) -> int:
        """Unfinished requests of this process (an n > 1 request counts once)."""
        return len(self._streams)

    @property
    def num_requests_admitted(self) -> int:
        """Unfinished requests counted against `max_requests` (of every server process sharing the slots)."""
        return self.slots.in_use

    def check_prompt(self, token_ids: List[int], params: SamplingParams) -> Optional[str]:
        """Why the engine would reject these prompt ids with params (None: they can run)."""
        return self.limits.check(token_ids, params)

    def open(self, prompt, params: SamplingParams, request_id: Optional[str] = None,
             admitted: bool = False) -> "RequestStream":
        """Queue a request and return its stream; raises EngineOverloaded / EngineClosed at once.
        admitted=True: the caller took its slot already (`slots.take(k)` for a batch admitted whole or not)."""
        if not self.is_running:
            raise EngineClosed("the engine is shutting down" if self._closing else "the engine loop is not running")
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        if not admitted and not self.slots.take(1):
            raise EngineOverloaded(f"{self.slots.in_use} requests in flight (the limit is {self.max_requests})")
        stream = self._streams[rid] = _Stream()
        self._submit(rid, prompt, params)
        return RequestStream(self, rid, stream)

    async def generate(self, prompt, params: SamplingParams,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until its finished one; closing the generator early aborts it."""
        stream = self.open(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        self._abort([request_id])

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new requests, let the ones in flight finish for up to drain_timeout_s, abort the rest,
        then stop the loop (under torchrun: release the other ranks)."""
        self._closing = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self._alive():
            await asyncio.sleep(0.02)
        if self._streams and self._alive():
            self._abort(list(self._streams))
        deadline = time.monotonic() + 5.0
        while self._streams and self._alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the abort outputs reach their readers
        await self._stop()

    # ------------------------------------------------------------------ the event loop side
    def _release(self, rid: str, abort: bool) -> None:
        """A stream is done with; abort=True: the engine frees the request's blocks."""
        if self._streams.pop(rid, None) is not None:
            self.slots.give(1)
            if abort and self._alive():
                self._abort([rid])

    def _dispatch(self, outputs: List[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
            if out.finished:
                for hook in self.on_finished:
                    try:
                        hook(out)
                    except Exception:
                        logger.exception("on_finished hook failed")

    def _fail(self, request_ids: Optional[List[str]], err: BaseException) -> None:
        for rid in request_ids if request_ids is not None else list(self._streams):
            stream = self._streams.get(rid)
            if stream is not None:
                stream.fail(err)


class RequestStream:
    """The outputs of one request, cumulative, until the finished one. `close()` before the end aborts it
    (synchronous, so it also works from a cancelled task's cleanup)."""

    def __init__(self, engine: StreamingEngine, request_id: str, stream: _Stream) -> None:
        self.engine, self.request_id, self._stream = engine, request_id, stream
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._stream.get()
        except (RequestFailed, EngineClosed):
            self._done = True
            self.engine._release(self.request_id, abort=False)  # the engine already dropped it
            raise
        if out.finished:
            self._done = True
            self.engine._release(self.request_id, abort=False)
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.engine._release(self.request_id, abort=True)
