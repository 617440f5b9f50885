"""Engine-side state of one request: its n sample sequences, their detokenizers and logprobs.

`n > 1` (vLLM's parallel sampling): the prompt is tokenized once and becomes n sequences (children)
that sample independently; the request's `RequestOutput.outputs` holds one CompletionOutput per
child, `index` 0..n-1, and the request is finished when every child is.

Seeds: child i samples exactly as an n=1 request with seed `seed + i` would (vLLM's rule), so each
completion of a seeded request can be reproduced alone; without a seed the children draw from the
engine's generator and differ. Greedy children are identical.

KV sharing: through the prefix cache. Child 0 (the leader) is admitted first; the other children
wait until the leader's prompt is computed (`Sequence.leader`, see scheduler.py), then take its full
prompt blocks from the cache and compute only the last partial block themselves. With prefix
caching off, every child computes the prompt.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Union

import numpy as np

from moe_infer.engine.detokenizer import IncrementalDetokenizer
from moe_infer.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.engine.sequence import Sequence


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n=1 SamplingParams child `index` samples with (seed + index when seeded)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


class Child:
    """One of the request's samples: its sequence, detokenizer and accumulated logprobs."""

    def __init__(self, index: int, seq: Sequence, detok: Optional[IncrementalDetokenizer]) -> None:
        self.index, self.seq, self.detok = index, seq, detok
        self.logprobs: Optional[List[Dict[int, Logprob]]] = [] if seq.params.logprobs is not None else None
        self.cumulative_logprob = 0.0

    @property
    def text(self) -> str:
        if self.detok is None:
            return ""
        return self.detok.text if self.seq.is_finished else self.detok.stable_text

    def add_logprobs(self, token: int, lp: tuple, decode: Callable[[int], Optional[str]]) -> None:
        chosen, rank, top_ids, top_vals = lp
        entry = {t: Logprob(v, r + 1, decode(t)) for r, (t, v) in enumerate(zip(top_ids, top_vals))}
        entry.setdefault(token, Logprob(chosen, rank, decode(token)))
        self.cumulative_logprob += chosen
        self.logprobs.append(entry)

    def completion(self) -> CompletionOutput:
        seq = self.seq
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(seq.output_token_ids),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, error=seq.error,
        )


class RequestState:
    def __init__(self, request_id: str, prompt: Optional[str], token_ids: Union[List[int], np.ndarray],
                 params: SamplingParams, tokenizer=None) -> None:
        """token_ids: the prompt's ids, a list or an int64 array (kept by the sequences: `Sequence.prompt_array`)."""
        self.request_id, self.params = request_id, params
        prompt_array = None
        if isinstance(token_ids, np.ndarray):
            if token_ids.dtype != np.int64 or token_ids.ndim != 1:
                raise ValueError(f"prompt ids as an array must be int64 [n], got {token_ids.dtype} {token_ids.shape}")
            prompt_array, token_ids = token_ids, token_ids.tolist()
        self.children: List[Child] = []
        self._prompt_ids: Optional[List[int]] = None  # one list shared by all of this request's outputs
        for i in range(params.n):
            p = child_params(params, i) if params.n > 1 else params
            seq = Sequence(request_id, token_ids, p, prompt=prompt, prompt_array=prompt_array)
            if i > 0:
                seq.leader = self.children[0].seq
                seq.metrics.arrival_time = self.children[0].seq.metrics.arrival_time
            detok = (IncrementalDetokenizer(tokenizer, token_ids, p.stop_strings, p.skip_special_tokens,
                                            p.include_stop_str_in_output) if tokenizer is not None else None)
            self.children.append(Child(i, seq, detok))

    @property
    def seqs(self) -> List[Sequence]:
        return [c.seq for c in self.children]

    @property
    def is_finished(self) -> bool:
        return all(c.seq.is_finished for c in self.children)

    def output(self) -> RequestOutput:
        """The request's cumulative output. Built every step for every running request under the server, so
        kept cheap: the prompt ids are copied once (outputs share that list: read it, do not change it)."""
        lead = self.children[0].seq
        if self._prompt_ids is None:
            self._prompt_ids = list(lead.prompt_token_ids)
        return RequestOutput(self.request_id, lead.prompt, self._prompt_ids,
                             [c.completion() for c in self.children], finished=self.is_finished,
                             metrics=self.metrics(), num_cached_tokens=lead.num_cached_tokens)

    def metrics(self) -> RequestMetrics:
        return _one_metrics(self.children[0].seq) if len(self.children) == 1 else self._metrics()

    def _metrics(self) -> RequestMetrics:
        """Over the children: first token of any, the mean per-token time, the last finish."""
        ms = [c.seq.metrics for c in self.children]
        arrival = ms[0].arrival_time
        firsts = [m.first_token_time for m in ms if m.first_token_time is not None]
        tpots = [(m.last_token_time - m.first_token_time) / (c.seq.num_output_tokens - 1)
                 for c, m in zip(self.children, ms) if c.seq.num_output_tokens > 1 and m.first_token_time is not None]
        done = [m.finished_time for m in ms]
        return RequestMetrics(
            arrival_time=arrival,
            time_to_first_token=min(firsts) - arrival if firsts else None,
            time_per_output_token=sum(tpots) / len(tpots) if tpots else None,
            e2e_latency=max(done) - arrival if all(t is not None for t in done) else None,
            num_preemptions=sum(m.num_preemptions for m in ms),
            num_cached_prompt_tokens=sum(c.seq.num_cached_tokens for c in self.children),
        )


def _one_metrics(seq: Sequence) -> RequestMetrics:
    """`RequestState._metrics` of an n=1 request, without the lists over children."""
    m, n = seq.metrics, seq.num_output_tokens
    first = m.first_token_time
    return RequestMetrics(
        arrival_time=m.arrival_time,
        time_to_first_token=None if first is None else first - m.arrival_time,
        time_per_output_token=(m.last_token_time - first) / (n - 1) if n > 1 and first is not None else None,
        e2e_latency=None if m.finished_time is None else m.finished_time - m.arrival_time,
        num_preemptions=m.num_preemptions, num_cached_prompt_tokens=seq.num_cached_tokens)
