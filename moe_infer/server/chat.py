"""POST /v1/chat/completions: the messages through the tokenizer's chat template, n samples, streamed or not.

Message content is a string or a list of text parts (other part types are a 400). `logprobs: true`
returns each token's logprob and, with `top_logprobs: k`, the k most likely tokens, in OpenAI's
chat shape. Streams send the role first, then content deltas, then the finish reason per choice.
"""
from __future__ import annotations

from typing import AsyncIterator, Dict, List

from fastapi import APIRouter, Request

from moe_infer.engine.async_engine import RequestFailed
from moe_infer.engine.chat_template import ChatTemplateError, render_chat
from moe_infer.engine.outputs import Logprob
from moe_infer.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, DeltaMessage,
                                       TokenLogprob, TopLogprob, now_s, random_id)
from moe_infer.server.serving import (GENERATE_RESPONSES, SSE_DONE, ApiError, Deltas, EventStream, ServerState,
                                      check_model, check_prompt, error_body, final_outputs, get_state, max_tokens_for,
                                      open_streams, sampling_params, sse, stop_reason, token_text, tokenize, usage)

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATE_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state = get_state(request)
    check_model(state, body.model)
    if body.tools:
        raise ApiError(400, "tools are not supported", "tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    ids = tokenize(state, _render(state, body), "messages", add_special_tokens=False)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = max_tokens_for(state, len(ids), body.max_completion_tokens or body.max_tokens, field)
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(state, body, max_tokens, num_logprobs, "top_logprobs")
    check_prompt(state, ids, params, "messages")
    rid, created = random_id("chatcmpl"), now_s()
    streams = open_streams(state, rid, [(None, ids, params)])
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(_stream(state, rid, created, streams, num_logprobs, include_usage), streams)
    out = (await final_outputs(request, streams))[0]
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                          stop_reason=stop_reason(c),
                          logprobs=_logprobs(c.token_ids, c.logprobs, num_logprobs) if c.logprobs is not None else None)
               for c in out.outputs]
    return ChatCompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                                  usage=usage([out]))


def _render(state: ServerState, body: ChatCompletionRequest) -> str:
    """The prompt text, as LLM.chat makes it (moe_infer/engine/chat_template.py); its errors are 400s."""
    try:
        return render_chat(state.tokenizer, [m.model_dump(include={"role", "content"}) for m in body.messages])
    except ChatTemplateError as err:
        raise ApiError(400, str(err), "messages") from None


def _logprobs(tokens: List[int], lps: List[Dict[int, Logprob]], k: int) -> ChatLogprobs:
    content = []
    for token, lp in zip(tokens, lps):
        top = sorted((t for t, v in lp.items() if v.rank <= k), key=lambda t: lp[t].rank)
        text = token_text(lp, token)
        content.append(TokenLogprob(
            token=text, logprob=lp[token].logprob, bytes=list(text.encode("utf-8")),
            top_logprobs=[TopLogprob(token=token_text(lp, t), logprob=lp[t].logprob,
                                     bytes=list(token_text(lp, t).encode("utf-8"))) for t in top]))
    return ChatLogprobs(content=content)


async def _stream(state: ServerState, rid: str, created: int, streams, num_logprobs, include_usage: bool
                  ) -> AsyncIterator[str]:
    def chunk(choices, usage_=None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=state.model_name, choices=choices, usage=usage_))

    deltas, final = Deltas(), None
    try:
        started = False
        async for out in streams[0]:
            if not started:  # the role first, once per choice (OpenAI's first chunk)
                started = True
                yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
                             for c in out.outputs])
            final = out if out.finished else None
            for c in out.outputs:
                if c.finish_reason == "error":
                    raise RequestFailed(f"generation failed: {c.error}")
                delta = deltas.next(c.index, c)
                if delta is None:
                    continue
                text, tokens, lps = delta
                yield chunk([ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=text or None), finish_reason=c.finish_reason,
                    stop_reason=stop_reason(c),
                    logprobs=_logprobs(tokens, lps, num_logprobs) if lps is not None else None)])
        if include_usage and final is not None:
            yield chunk([], usage([final]))
    except RequestFailed as err:
        yield sse(error_body(500, str(err)))
    yield SSE_DONE
