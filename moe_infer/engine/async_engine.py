"""AsyncEngine: the engine loop in a background thread, one output stream per request for asyncio.

    engine = AsyncEngine(LLMEngine(cfg, path), max_requests=512)
    await engine.start()                                      # inside the server's event loop
    async for out in engine.generate(prompt, params, "req-1"):  # cumulative RequestOutputs
        ...
    await engine.shutdown(drain_timeout_s=10)                 # finish or abort what is in flight

One thread owns the `LLMEngine` (the same core `LLM` drives): between steps it runs the commands the
event loop queued (add, abort, a stats read), then `LLMEngine.step()` while requests are unfinished,
and hands each step's outputs to the event loop in one `call_soon_threadsafe`. Nothing else touches
the engine, so it needs no lock, and HTTP work runs while the device computes.

Streams: outputs are cumulative, so a request's stream keeps only the newest one (a slow reader skips
to it instead of queueing copies). A generator that is closed early (client disconnect, task
cancelled) aborts its request; the engine thread frees the KV blocks before its next step. A request
whose engine step raises gets its error as an output (finish_reason "error"); an error outside a step
fails the requests in flight with `RequestFailed` and the loop goes on. Past `max_requests` unfinished
requests, `generate` raises `EngineOverloaded` at once (the server answers 429).

Under torchrun (a mesh: parallel.tp, pp or ep > 1) this runs on the driver rank; the other ranks run
the driver's steps (`moe_infer.parallel.pipeline.serve`), waiting between requests on a control group
that has no step timeout, and `shutdown` releases them (the executor's `finish`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable, Dict, List, Optional

from moe_infer.engine.llm_engine import LLMEngine, PromptType
from moe_infer.engine.outputs import RequestOutput
from moe_infer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """Too many unfinished requests: retry later."""


class EngineClosed(RuntimeError):
    """The engine is shutting down or its loop has stopped."""


class RequestFailed(RuntimeError):
    """The engine failed outside a step while this request was in flight."""


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


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_requests: int = 1024,
                 on_finished: Optional[List[Callable[[RequestOutput], None]]] = None) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.engine, self.max_requests = engine, max_requests
        self.on_finished = list(on_finished or [])
        self._streams: Dict[str, _Stream] = {}
        self._commands: "queue.SimpleQueue" = queue.SimpleQueue()
        self._ids = itertools.count()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._closing = False
        self.num_loop_errors = 0  # errors outside a step (each failed the requests in flight)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="moe-infer-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    @property
    def num_requests(self) -> int:
        """Unfinished requests (an n > 1 request counts once)."""
        return len(self._streams)

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new requests, let the ones in flight finish for up to drain_timeout_s, abort the rest,
        then stop the loop (under torchrun: release the other ranks)."""
        self._closing = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self._streams):
            self._commands.put((lambda r=rid: self.engine.abort_request(r), None))
        deadline = time.monotonic() + 5.0
        while self._streams and self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the abort outputs reach their readers
        if self._thread is not None:
            self._commands.put(None)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ------------------------------------------------------------------ requests
    def open(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None) -> "RequestStream":
        """Queue a request and return its stream; raises EngineOverloaded / EngineClosed at once (no await
        between a caller's capacity check and its `open` calls, so a batch is admitted whole or not)."""
        if not self.is_running:
            raise EngineClosed("the engine is shutting down" if self._closing else "the engine loop is not running")
        if len(self._streams) >= self.max_requests:
            raise EngineOverloaded(f"{len(self._streams)} requests in flight (the limit is {self.max_requests})")
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        stream = self._streams[rid] = _Stream()
        self._commands.put((lambda: self._add(prompt, params, rid), None))
        return RequestStream(self, rid, stream)

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until its finished one; closing the generator early aborts it."""
        stream = self.open(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        await self.call(lambda: self.engine.abort_request(request_id))

    async def call(self, fn: Callable):
        """fn() on the engine thread between two steps; its result (or exception) here."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineClosed("the engine loop is not running")
        fut = self._loop.create_future()
        self._commands.put((fn, fut))
        return await fut

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # the loop itself died (e.g. a collective timed out): fail everything
            logger.exception("the engine loop stopped")
            self._closing = True
            error = EngineClosed(f"the engine loop stopped: {type(err).__name__}: {err}")
            self._loop.call_soon_threadsafe(self._fail, None, error)
            cmds, _ = self._take_commands(wait=False)
            for _, fut in cmds:
                if fut is not None:
                    self._loop.call_soon_threadsafe(_resolve, fut, None, error)

    def _serve(self) -> None:
        engine = self.engine
        while True:
            cmds, stop = self._take_commands(wait=not engine.has_unfinished_requests())
            for fn, fut in cmds:
                self._run_command(fn, fut)
            if stop:
                break
            if engine.has_unfinished_requests():
                self._step()
        engine.executor.finish([])

    def _take_commands(self, wait: bool):
        """(the queued commands, whether the stop marker came); waits for one if asked."""
        cmds = []
        try:
            item = self._commands.get() if wait else self._commands.get_nowait()
            while item is not None:
                cmds.append(item)
                item = self._commands.get_nowait()
            return cmds, True
        except queue.Empty:
            return cmds, False

    def _add(self, prompt: PromptType, params: SamplingParams, rid: str) -> None:
        try:
            self.engine.add_request(prompt, params, rid)
        except Exception as err:  # e.g. a prompt of the wrong type: this request fails, nothing else
            self._loop.call_soon_threadsafe(self._fail, [rid], RequestFailed(f"{type(err).__name__}: {err}"))

    def _release(self, rid: str, abort: bool) -> None:
        """A stream is done with (event loop side); abort=True: the engine frees the request's blocks."""
        if self._streams.pop(rid, None) is not None and abort:
            self._commands.put((lambda: self.engine.abort_request(rid), None))

    def _run_command(self, fn: Callable, fut: Optional[asyncio.Future]) -> None:
        try:
            result, error = fn(), None
        except Exception as err:  # reported to the caller; the loop goes on
            result, error = None, err
            if fut is None:
                logger.exception("engine command failed")
        if fut is not None:
            self._loop.call_soon_threadsafe(_resolve, fut, result, error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # not a forward failure (the engine handles those): fail what is in flight
            logger.exception("engine step failed outside the forward; failing the requests in flight")
            self.num_loop_errors += 1
            failed = list(self.engine.requests)
            for rid in failed:
                self.engine.abort_request(rid)  # frees their blocks; the abort outputs come with the next step
            self._loop.call_soon_threadsafe(self._fail, failed, RequestFailed(f"{type(err).__name__}: {err}"))
            return
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    # ------------------------------------------------------------------ the event loop side
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


def _resolve(fut: asyncio.Future, result, error: Optional[BaseException]) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class RequestStream:
    """The outputs of one request, cumulative, until the finished one. `close()` before the end aborts it
    (synchronous, so it also works from a cancelled task's cleanup)."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
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
