"""Detokenization and stop strings on the client side of an engine core, as vLLM's front end does them.

The engine core (moe_infer/engine/core_proc.py) runs its LLMEngine with `detokenize=False`, so its deltas
carry token ids and logprobs but no text. `DetokenizingAssembler` (one per request, in the server's
process) rebuilds the cumulative outputs with `OutputAssembler`, then feeds each sample's new tokens to
an `IncrementalDetokenizer` of its own. That is the detokenizer the offline engine uses, with the same
rules around it (`LLMEngine.step`), so texts, held-back tails, finish reasons and token ids come out as
the offline engine's:

- a stop string found here ends the sample at once in what this side returns (finish_reason "stop", the
  token that completed it is the last one, the text cut as the engine cuts it) and
  `on_stop(request_id, index, stop)` tells the core. The core ran on until that command came: tokens it
  sends for the sample afterwards are dropped;
- a stop string completed by the token the core ended the sample with keeps the core's finish reason;
- a sample the core ended by length whose held-back tail, flushed, holds a stop string ends with "stop";
- logprob entries get their decoded tokens here.

The request finishes when the core says so (its metrics come with that message); a sample stopped here
shows as finished before that.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from moe_infer.engine.detokenizer import IncrementalDetokenizer, backend_decode
from moe_infer.engine.output_delta import OutputAssembler
from moe_infer.engine.outputs import CompletionOutput, RequestOutput
from moe_infer.engine.sampling_params import SamplingParams

OnStop = Callable[[str, int, str], None]


class DetokenizingAssembler:
    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int], params: SamplingParams,
                 tokenizer, on_stop: OnStop) -> None:
        n = params.n
        self.request_id, self.on_stop = request_id, on_stop
        self._base = OutputAssembler(request_id, prompt, prompt_token_ids, n, params.logprobs is not None)
        self._detoks = [IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop_strings,
                                               params.skip_special_tokens, params.include_stop_str_in_output)
                        for _ in range(n)]
        self._fed = [0] * n  # tokens of each sample given to its detokenizer
        self._decoded = [0] * n  # logprob entries given their decoded tokens
        self._stopped: List[Optional[Tuple[int, str]]] = [None] * n  # (tokens kept, stop string): ended here
        self._final: List[Optional[CompletionOutput]] = [None] * n  # a sample's last output, once it ended
        self._decode = backend_decode(tokenizer) or tokenizer.decode  # logprobs' tokens, special ones shown

    def apply(self, wire: tuple) -> RequestOutput:
        self._base.update(wire)
        return self._base.output(wire, [self._choice(c) for c in self._base.choices])

    def _choice(self, c: CompletionOutput) -> CompletionOutput:
        i = c.index
        if self._final[i] is not None:
            return self._final[i]
        detok, ids = self._detoks[i], c.token_ids
        finish, stop_reason = c.finish_reason, c.stop_reason
        stop = None
        while stop is None and self._fed[i] < len(ids):
            self._fed[i] += 1
            _, stop = detok.add_token(ids[self._fed[i] - 1])
        if stop is not None and not (finish is not None and self._fed[i] == len(ids)):
            # as the engine finishes a running sample on its stop string (the core had not ended it there)
            self._stopped[i] = (self._fed[i], stop)
            if finish is None:
                self.on_stop(self.request_id, i, stop)
            finish, stop_reason = "stop", stop
        elif stop is None and finish in ("length", "stop"):  # ended by its last token: the held-back tail shows
            _, stop = detok.flush()
            if stop is not None and finish == "length":
                finish, stop_reason = "stop", stop
        keep = self._stopped[i][0] if self._stopped[i] is not None else len(ids)
        logprobs = c.logprobs
        if logprobs is not None:
            self._decode_logprobs(i, logprobs, keep)
        if finish is None:
            return CompletionOutput(i, detok.stable_text, ids, logprobs, c.cumulative_logprob, None, None, c.error)
        final = self._final[i] = CompletionOutput(
            i, detok.text, ids[:keep], logprobs[:keep] if logprobs is not None else None,
            self._cumulative(ids, logprobs, keep, c.cumulative_logprob), finish, stop_reason, c.error)
        return final

    def _decode_logprobs(self, i: int, logprobs: list, keep: int) -> None:
        for entry in logprobs[self._decoded[i]:keep]:
            for token, lp in entry.items():
                lp.decoded_token = self._decode([token], skip_special_tokens=False)
        self._decoded[i] = max(self._decoded[i], min(keep, len(logprobs)))

    @staticmethod
    def _cumulative(ids: List[int], logprobs, keep: int, core_value: Optional[float]) -> Optional[float]:
        """The cumulative logprob of the kept tokens (the core's also counts the tokens dropped here), summed
        in the engine's order."""
        if logprobs is None or keep == len(logprobs):
            return core_value
        total = 0.0
        for token, entry in zip(ids[:keep], logprobs):
            total += entry[token].logprob
        return total
