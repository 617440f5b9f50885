"""Outputs as deltas: what an engine in another process sends of each step, and how a client rebuilds them.

The engine's `RequestOutput`s are cumulative (every token, the whole text), so sending them each step
would cost O(length) per request per step. `DeltaEncoder` (engine side) sends what changed since the
last output of the request: per choice, the text and token ids past what was sent (as "keep the first
`text_keep` characters, then add `text`", so a text that ever shrinks, e.g. a stop string cut at the
end, still arrives right), the new logprob entries, and the finish fields. Token ids are taken as the
engine makes them: appended, never rewritten in place (a list that gets shorter is handled). `OutputAssembler` (client
side, one per request) applies them to its own lists and returns cumulative `RequestOutput`s equal to
the engine's. The prompt never travels: the client has it.

Outputs returned by one assembler share their lists with the later ones of the same request (appending
is what keeps the client O(new tokens)): read the newest output, as a stream's reader does.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

from moe_infer.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class ChoiceDelta(NamedTuple):
    index: int
    text_keep: int  # characters of the text sent before that stay
    text: str  # appended after them
    token_keep: int  # token ids (and logprob entries) sent before that stay
    token_ids: List[int]
    logprobs: Optional[List[Dict[int, Logprob]]]  # entries of the new token ids; None without logprobs
    cumulative_logprob: Optional[float]
    finish_reason: Optional[str]
    stop_reason: object
    error: Optional[str]


class OutputDelta(NamedTuple):
    request_id: str
    choices: List[ChoiceDelta]  # the choices that changed
    finished: bool
    metrics: Optional[RequestMetrics]
    num_cached_tokens: int


class DeltaEncoder:
    """Engine side: each request's output as the delta from the one sent before (forgets finished requests)."""

    def __init__(self) -> None:
        self._sent: Dict[str, Dict[int, Tuple[str, int, Optional[str]]]] = {}  # id -> index -> (text, tokens, finish)

    def encode(self, out: RequestOutput) -> OutputDelta:
        sent = self._sent.setdefault(out.request_id, {})
        choices = []
        for c in out.outputs:
            text, num_tokens, finish = sent.get(c.index, ("", 0, None))
            if c.text == text and len(c.token_ids) == num_tokens and c.finish_reason == finish:
                continue
            keep = len(text) if c.text.startswith(text) else _common_prefix(text, c.text)
            tokens_keep = min(num_tokens, len(c.token_ids))
            choices.append(ChoiceDelta(
                c.index, keep, c.text[keep:], tokens_keep, c.token_ids[tokens_keep:],
                c.logprobs[tokens_keep:] if c.logprobs is not None else None, c.cumulative_logprob,
                c.finish_reason, c.stop_reason, c.error))
            sent[c.index] = (c.text, len(c.token_ids), c.finish_reason)
        if out.finished:
            del self._sent[out.request_id]
        return OutputDelta(out.request_id, choices, out.finished, out.metrics, out.num_cached_tokens)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class OutputAssembler:
    """Client side, one request: deltas in, cumulative RequestOutputs out."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int], n: int,
                 logprobs: bool = False) -> None:
        """n choices, as the engine starts them (with logprobs: empty lists, a cumulative 0.0)."""
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.choices = [CompletionOutput(index=i, text="", token_ids=[], logprobs=[] if logprobs else None,
                                         cumulative_logprob=0.0 if logprobs else None) for i in range(n)]

    def apply(self, delta: OutputDelta) -> RequestOutput:
        for d in delta.choices:
            c = self.choices[d.index]
            c.text = c.text[:d.text_keep] + d.text if d.text_keep < len(c.text) else c.text + d.text
            if d.token_keep < len(c.token_ids):
                del c.token_ids[d.token_keep:]
                if c.logprobs is not None:
                    del c.logprobs[d.token_keep:]
            c.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                c.logprobs.extend(d.logprobs)
            c.cumulative_logprob, c.finish_reason, c.stop_reason, c.error = (
                d.cumulative_logprob, d.finish_reason, d.stop_reason, d.error)
        outputs = [CompletionOutput(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason,
                                    c.stop_reason, c.error) for c in self.choices]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, delta.finished,
                             metrics=delta.metrics, num_cached_tokens=delta.num_cached_tokens)
