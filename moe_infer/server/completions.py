"""POST /v1/completions: one prompt or a batch (strings or token ids), n samples each, streamed or not.

Choice `index` is `prompt_index * n + sample_index`, as in OpenAI's API. `echo` prepends the prompt
text (not with logprobs: prompt logprobs are not computed). Logprobs are OpenAI's legacy shape
(tokens, token_logprobs, top_logprobs, text_offset) of the raw model distribution.
"""
from __future__ import annotations

from typing import AsyncIterator, Dict, List, Optional

from fastapi import APIRouter, Request

from moe_infer.engine.async_engine import RequestFailed
from moe_infer.engine.outputs import Logprob, RequestOutput
from moe_infer.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                       now_s, random_id)
from moe_infer.server.serving import (GENERATE_RESPONSES, SSE_DONE, ApiError, Deltas, EventStream, ServerState,
                                      check_model, check_prompt, error_body, final_outputs, get_state, max_tokens_for,
                                      merged, open_streams, sampling_params, sse, stop_reason, token_text, tokenize, usage)

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATE_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request):
    state = get_state(request)
    check_model(state, body.model)
    if body.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, f"best_of={body.best_of} must equal n={body.n} (extra samples are not ranked)", "best_of")
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo")
    prompts = _prompt_list(body.prompt)
    prepared = []
    for p in prompts:
        ids = tokenize(state, p, "prompt")
        params = sampling_params(state, body, max_tokens_for(state, len(ids), body.max_tokens, "max_tokens"),
                                 body.logprobs, "logprobs")
        check_prompt(state, ids, params, "prompt")
        prepared.append((p if isinstance(p, str) else _echo_text(state, ids, body.echo), ids, params))
    rid, created = random_id("cmpl"), now_s()
    streams = open_streams(state, rid, prepared)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(_stream(state, body, rid, created, streams, include_usage), streams)
    outs = await final_outputs(request, streams)
    choices = [_choice(body, o, i * body.n + c.index, c) for i, o in enumerate(outs) for c in o.outputs]
    return CompletionResponse(id=rid, created=created, model=state.model_name, choices=choices, usage=usage(outs))


def _echo_text(state: ServerState, ids: List[int], echo: bool) -> Optional[str]:
    """The text of a prompt sent as ids, decoded only where echo returns it (the engine does not decode id
    prompts); None without a tokenizer (echo then returns the completion alone)."""
    return state.tokenizer.decode(ids) if echo and state.tokenizer is not None else None


def _prompt_list(prompt) -> List:
    """str | [str] | [int] | [[int]] -> a list of prompts (each a str or a list of ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _choice(body: CompletionRequest, out: RequestOutput, index: int, c) -> CompletionChoice:
    text = (out.prompt or "") + c.text if body.echo else c.text
    lps = _logprobs(c.token_ids, c.logprobs, 0) if c.logprobs is not None else None
    return CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=c.finish_reason,
                            stop_reason=stop_reason(c))


def _logprobs(tokens: List[int], lps: List[Dict[int, Logprob]], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token, lp in zip(tokens, lps):
        text = token_text(lp, token)
        out.tokens.append(text)
        out.token_logprobs.append(lp[token].logprob)
        out.top_logprobs.append({token_text(lp, t): v.logprob for t, v in lp.items()})  # top-k + the chosen
        out.text_offset.append(offset)
        offset += len(text)
    return out


async def _stream(state: ServerState, body: CompletionRequest, rid: str, created: int, streams,
                  include_usage: bool) -> AsyncIterator[str]:
    deltas, offsets = Deltas(), {}
    finals: Dict[int, RequestOutput] = {}
    n = body.n
    try:
        async for i, out in merged(streams):
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                index = i * n + c.index
                if c.finish_reason == "error":
                    raise RequestFailed(f"generation failed: {c.error}")
                delta = deltas.next(index, c)
                if delta is None:
                    continue
                text, tokens, lps = delta
                if body.echo and index not in offsets:
                    text = (out.prompt or "") + text
                offset = offsets.get(index, 0)
                offsets[index] = offset + len(text)
                choice = CompletionChoice(
                    index=index, text=text, finish_reason=c.finish_reason, stop_reason=stop_reason(c),
                    logprobs=_logprobs(tokens, lps, offset) if lps is not None else None)
                yield sse(CompletionResponse(id=rid, created=created, model=state.model_name, choices=[choice]))
        if include_usage:
            yield sse(CompletionResponse(id=rid, created=created, model=state.model_name, choices=[],
                                         usage=usage([finals[i] for i in sorted(finals)])))
    except RequestFailed as err:
        yield sse(error_body(500, str(err)))
    yield SSE_DONE
