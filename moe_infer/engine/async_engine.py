"""AsyncEngine: the engine loop in a thread of this process, one output stream per request for asyncio.

    engine = AsyncEngine(LLMEngine(cfg, path), max_requests=512)
    await engine.start()                                      # inside the server's event loop
    async for out in engine.generate(prompt, params, "req-1"):  # cumulative RequestOutputs
        ...
    await engine.shutdown(drain_timeout_s=10)                 # finish or abort what is in flight

The streams, admission and shutdown are `StreamingEngine`'s (moe_infer/engine/request_streams.py); the
server's default is `ProcessEngine` (moe_infer/engine/core_client.py), the same calls with the engine in
a process of its own, so that HTTP work and the engine loop do not share one GIL. This one suits an
application that embeds the engine in its own event loop, and tests.

One thread owns the `LLMEngine` (the same core `LLM` drives): between steps it runs the commands the
event loop queued (add, abort, a read), then `LLMEngine.step()` while requests are unfinished, and hands
each step's outputs to the event loop in one `call_soon_threadsafe`. Nothing else touches the engine, so
it needs no lock. A request whose add raises fails alone (`RequestFailed`); an error outside a step fails
the requests in flight and the loop goes on.

Under torchrun (a mesh: parallel.tp, pp or ep > 1) this runs on the driver rank; the other ranks run
the driver's steps (`moe_infer.parallel.pipeline.serve`), waiting between requests on a control group
that has no step timeout, and `shutdown` releases them (the executor's `finish`).
"""
from __future__ import annotations

import asyncio
import logging
import queue
from typing import Callable, List, Optional, Sequence

from moe_infer.engine.introspection import run_utility
from moe_infer.engine.llm_engine import LLMEngine
from moe_infer.engine.outputs import RequestOutput
from moe_infer.engine.request_streams import (EngineClosed, EngineOverloaded, RequestFailed, RequestStream,
                                              StreamingEngine)
from moe_infer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
__all__ = ["AsyncEngine", "EngineClosed", "EngineOverloaded", "RequestFailed", "RequestStream"]


class AsyncEngine(StreamingEngine):
    def __init__(self, engine: LLMEngine, max_requests: int = 1024,
                 on_finished: Optional[List[Callable[[RequestOutput], None]]] = None) -> None:
        super().__init__(max_requests, on_finished)
        self.engine = engine
        self.tokenizer, self.max_model_len, self.limits = engine.tokenizer, engine.max_model_len, engine.limits
        self._commands: "queue.SimpleQueue" = queue.SimpleQueue()
        self.num_loop_errors = 0  # errors outside a step (each failed the requests in flight)

    # ------------------------------------------------------------------ lifecycle
    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def _stop(self) -> None:
        if self._thread is not None:
            self._commands.put(None)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ------------------------------------------------------------------ commands
    def _submit(self, request_id: str, prompt, params: SamplingParams) -> None:
        self._commands.put((lambda: self._add(prompt, params, request_id), None))

    def _abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._commands.put((lambda r=rid: self.engine.abort_request(r), None))

    async def utility(self, name: str):
        return await self.call(lambda: run_utility(self.engine, name))

    async def call(self, fn: Callable):
        """fn() on the engine thread between two steps; its result (or exception) here."""
        if not self._alive():
            raise EngineClosed("the engine loop is not running")
        fut = self._loop.create_future()
        self._commands.put((fn, fut))
        return await fut

    # ------------------------------------------------------------------ the engine thread
    def _thread_main(self) -> None:
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

    def _add(self, prompt, params: SamplingParams, rid: str) -> None:
        try:
            self.engine.add_request(prompt, params, rid)
        except Exception as err:  # e.g. a prompt of the wrong type: this request fails, nothing else
            self._loop.call_soon_threadsafe(self._fail, [rid], RequestFailed(f"{type(err).__name__}: {err}"))

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


def _resolve(fut: asyncio.Future, result, error: Optional[BaseException]) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
