"""What the endpoint modules share: the server's state, errors in OpenAI's shape, request fields ->
SamplingParams, prompt checks (400s before anything reaches the engine), admission (429), and
running the engine requests of one HTTP request: to the end, or as a stream of per-choice deltas,
aborted when the client goes away.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from moe_infer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from moe_infer.engine.request_streams import RequestStream, StreamingEngine
from moe_infer.engine.encode import encode
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.server.config import ServeConfig
from moe_infer.server.protocol import ErrorInfo, ErrorResponse, PromptTokensDetails, Usage

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error"}
ERROR_RESPONSES: Dict[int, Dict[str, Any]] = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 503)}
GENERATE_RESPONSES: Dict[int, Dict[str, Any]] = {  # + the JSON body of the route's response_model
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
          "description": "the completion; with `stream: true`, server-sent events ending in `data: [DONE]`"},
    500: {"model": ErrorResponse, "description": "the generation failed"}, **ERROR_RESPONSES}
SSE_DONE = "data: [DONE]\n\n"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: Optional[str] = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "server_error"),
                                         param=param, code=status))


def error_response(status: int, message: str, param: Optional[str] = None,
                   headers: Optional[Dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status, headers=headers)


def sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


@dataclass
class ServerState:
    engine: StreamingEngine
    cfg: ServeConfig
    model_name: str
    model_path: str
    tokenizer: Any
    max_model_len: int
    created: int
    metrics: Any = None  # ServerMetrics, when prometheus-client is there

    @property
    def max_prompt_tokens(self) -> int:
        return min(self.cfg.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1)


def get_state(request: Request) -> ServerState:
    return request.app.state.server


# ---------------------------------------------------------------------- request checks
def check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise ApiError(404, f"The model `{name}` does not exist (this server serves `{state.model_name}`).", "model")


def sampling_params(state: ServerState, req, max_tokens: int, logprobs: Optional[int],
                    logprobs_field: str) -> SamplingParams:
    cfg = state.cfg
    if req.n > cfg.max_n:
        raise ApiError(400, f"n={req.n} is more than this server allows ({cfg.max_n})", "n")
    if logprobs is not None and logprobs > cfg.max_logprobs:
        raise ApiError(400, f"{logprobs_field}={logprobs} is more than this server allows ({cfg.max_logprobs})",
                       logprobs_field)
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options can only be set when stream is true", "stream_options")
    try:
        return SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=-1 if req.top_k == 0 else req.top_k,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            max_tokens=max_tokens, min_tokens=min(req.min_tokens, max_tokens), ignore_eos=req.ignore_eos,
            logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as err:
        field = re.search(r"SamplingParams\.(\w+)", str(err))
        raise ApiError(400, str(err), field.group(1) if field else None) from None


def max_tokens_for(state: ServerState, num_prompt: int, requested: Optional[int], field: str) -> int:
    """The tokens a prompt of num_prompt tokens may generate (the room left when not given)."""
    room = state.max_model_len - num_prompt
    if requested is None:
        return room
    if requested > room:
        raise ApiError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                            f"requested {num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} for "
                            f"the completion). Please reduce the length of the prompt or {field}.", field)
    return requested


def tokenize(state: ServerState, prompt, field: str, add_special_tokens: bool = True) -> List[int]:
    if isinstance(prompt, list):
        ids = prompt
    elif state.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send token ids", field)
    else:
        ids = encode(state.tokenizer, prompt, add_special_tokens=add_special_tokens)
    if len(ids) > state.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {len(ids)} tokens, more than this server accepts "
                            f"({state.max_prompt_tokens}; max_model_len is {state.max_model_len})", field)
    return ids


def check_prompt(state: ServerState, ids: List[int], params: SamplingParams, field: str) -> None:
    error = state.engine.check_prompt(ids, params)  # the engine's limits, held here: no round trip
    if error is not None:
        raise ApiError(400, error, field)


# ---------------------------------------------------------------------- running
def open_streams(state: ServerState, base_id: str,
                 prompts: Sequence[Tuple[Optional[str], List[int], SamplingParams]]) -> List[RequestStream]:
    """One engine request per prompt, admitted together or refused together (429 / 503)."""
    engine = state.engine
    if not engine.is_running:
        raise ApiError(503, "the server is shutting down")
    if not engine.slots.take(len(prompts)):  # all or none, counted across the server processes
        if state.metrics is not None:
            state.metrics.rejected("queue_full")
        raise ApiError(429, f"the server is at capacity ({engine.num_requests_admitted} requests in flight); "
                            "retry later", headers={"Retry-After": str(state.cfg.retry_after_s)})
    streams: List[RequestStream] = []
    try:
        for i, (text, ids, params) in enumerate(prompts):
            streams.append(engine.open({"prompt_token_ids": ids, "prompt": text}, params, f"{base_id}-{i}",
                                       admitted=True))
    except BaseException:
        engine.slots.give(len(prompts) - len(streams))
        for s in streams:
            s.close()
        raise
    return streams


async def final_outputs(request: Request, streams: List[RequestStream]) -> List[RequestOutput]:
    """The finished output of every stream; all are aborted if the client disconnects first."""
    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    results = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not results.done():
            raise ApiError(499, "the client disconnected")
        outs = results.result()
    finally:
        gone.cancel()
        results.cancel()
        for s in streams:
            s.close()
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "error":
                raise ApiError(500, f"generation failed: {c.error}")
    return outs


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merged(streams: List[RequestStream]) -> AsyncIterator[Tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come (one stream: read directly, without the
    extra task and queue hop per output that merging costs)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as err:
            queue.put_nowait((i, None, err))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


class EventStream(StreamingResponse):
    """Server-sent events; the engine requests behind it are aborted however the response ends."""

    def __init__(self, body: AsyncIterator[str], streams: List[RequestStream]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                s.close()


class Deltas:
    """What a stream has sent of each choice: the new text, token count and logprobs of the next output."""

    def __init__(self) -> None:
        self.sent: Dict[int, Tuple[int, int]] = {}
        self.done: set = set()

    def next(self, index: int, c: CompletionOutput) -> Optional[Tuple[str, List[int], Optional[List[Dict[int, Logprob]]]]]:
        """(new text, new token ids, their logprobs) of choice `index`, or None when there is nothing to send."""
        if index in self.done:
            return None
        n_text, n_tok = self.sent.get(index, (0, 0))
        text, tokens = c.text[n_text:], c.token_ids[n_tok:]
        if not text and c.finish_reason is None:
            return None  # tokens whose text is held back (a possible stop string, half a character) wait
        self.sent[index] = (len(c.text), len(c.token_ids))
        if c.finish_reason is not None:
            self.done.add(index)
        return text, tokens, c.logprobs[n_tok:] if c.logprobs is not None else None


def usage(outputs: List[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs)))


def stop_reason(c: CompletionOutput):
    return c.stop_reason if isinstance(c.stop_reason, (int, str)) else None


def token_text(lp: Dict[int, Logprob], token: int) -> str:
    return lp[token].decoded_token or ""
