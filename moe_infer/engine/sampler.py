"""The sampler: logits of the sequences that sample this step -> next tokens (+ logprobs).

Vectorised over the batch: penalties, temperature, top-k, top-p and min-p are tensor ops on
[B, V]; the only per-sequence work is drawing the random noise of a request with its own seed
from its own torch.Generator (so a seeded request samples the same tokens alone or in any batch).
Sampling uses the exponential race: argmax(p / q), q ~ Exp(1), which draws from p exactly.
Logprobs are those of the raw model logits (before penalties and temperature), as vLLM reports.

`sample` only launches work: every host value goes to the device without a stream sync, and the
results come back through a non-blocking copy into pinned memory and an event (`SampledTokens`), so
the host can prepare the next step while the device samples; `SampledTokens.result()` waits. On CUDA the copy
runs on a side stream, so the next step's work on the compute stream does not queue behind it. Its
`token_ids_B` stay on the device for async scheduling: the next step's placeholders are read there.

Legend: B sequences that sample, V vocabulary, Kp logprobs requested (max over the batch).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence as Seq

import torch

from moe_infer.engine.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """What the sampler needs of one sequence (built from the plan's ScheduledSeq)."""

    seq_id: int
    params: SamplingParams
    num_prompt_tokens: int
    num_output_tokens: int
    history: Optional[List[int]] = None  # prompt + output tokens; needed when params.has_penalties
    # async scheduling: history lacks its last token, sampled by the step before and not on the host yet; it
    # is this step's input token, given to `sample` on the device (input_ids_B)
    last_on_device: bool = False


@dataclass
class SamplerOutput:
    token_ids: List[int]
    # per sequence: None, or (chosen logprob, chosen rank, top token ids, top logprobs)
    logprobs: List[Optional[tuple]]


class SampledTokens:
    """A launched sample: token ids on the device, their copy (and the logprobs') on its way to the host."""

    def __init__(self, token_ids_B: torch.Tensor, logprobs: Optional[List[torch.Tensor]],
                 num_lp: List[Optional[int]]) -> None:
        self.token_ids_B, self.num_lp = token_ids_B, num_lp
        tensors = [token_ids_B] + (logprobs or [])
        self._event = None
        if not token_ids_B.is_cuda:
            self._host = tensors
            return
        stream = _copy_stream(token_ids_B.device)
        if stream is not None:  # the copies wait on the sample, the compute stream does not wait on them
            stream.wait_stream(torch.cuda.current_stream(token_ids_B.device))
            for t in tensors:
                t.record_stream(stream)  # the allocator must not hand their memory out before the copies ran
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._host = [_to_host(t) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SamplerOutput:
        """Waits for the sample (the device work before it included) and reads it on the host."""
        if self._event is not None:
            self._event.synchronize()
        tokens, *lp = [t.tolist() for t in self._host]
        if not lp:
            return SamplerOutput(tokens, [None] * len(self.num_lp))
        chosen, rank, top_vals, top_ids = lp
        return SamplerOutput(tokens, [None if n is None else (chosen[i], rank[i], top_ids[i][:n], top_vals[i][:n])
                                      for i, n in enumerate(self.num_lp)])


# "0": the sampled tokens' device-to-host copy runs on the compute stream, before the next step's work (A/B runs)
COPY_STREAM_ENV = "MOE_SAMPLE_COPY_STREAM"
_copy_streams: Dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """The side stream of device that copies sampled tokens to the host (None: on the compute stream). On the
    compute stream the copy sat between the sample and the next step's input copy, a copy-engine hop each way
    (on an H100 at batch 1 it and the gaps around it took ~10 us of a ~775 us step)."""
    if os.environ.get(COPY_STREAM_ENV, "1") == "0":
        return None
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device)
    return _copy_streams[device]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _on(device: torch.device, values, dtype=None) -> torch.Tensor:
    """A host list as a device tensor, without the stream sync of torch.tensor(..., device=cuda)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Seq[int], device: torch.device, seed: int = 0) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._seeded: Dict[int, torch.Generator] = {}

    def forget(self, seq_ids: Seq[int]) -> None:
        for s in seq_ids:
            self._seeded.pop(s, None)

    def __call__(self, logits_BV: torch.Tensor, reqs: List[SampleRequest]) -> SamplerOutput:
        return self.sample(logits_BV, reqs).result()

    @staticmethod
    def argmax_only(reqs: List[SampleRequest]) -> bool:
        """Every request greedy, without logprobs, penalties or a min_tokens ban: the step's tokens are the
        argmax of the raw logits (in any dtype: a float32 cast keeps their order), one launch."""
        return all(r.params.is_greedy and r.params.logprobs is None and not r.params.has_penalties
                   and r.num_output_tokens >= r.params.min_tokens for r in reqs)

    def sample(self, logits_BV: torch.Tensor, reqs: List[SampleRequest],
               input_ids_B: Optional[torch.Tensor] = None) -> SampledTokens:
        """logits_BV: in any float dtype (cast to float32 here unless the step is `argmax_only`); input_ids_B: each
        row's input token, on the device; needed when a request is `last_on_device`."""
        B, V = logits_BV.shape
        assert B == len(reqs), f"{B} logit rows for {len(reqs)} requests"
        num_lp = [r.params.logprobs for r in reqs]
        if self.argmax_only(reqs):
            return SampledTokens(logits_BV.argmax(-1), None, num_lp)
        logits_BV = logits_BV.float()
        raw_logprobs_BV = torch.log_softmax(logits_BV, -1) if any(n is not None for n in num_lp) else None
        logits_BV = self._apply_penalties(logits_BV, reqs, input_ids_B)
        logits_BV = self._apply_min_tokens(logits_BV, reqs)
        greedy = [r.params.is_greedy for r in reqs]
        if all(greedy):
            tokens_B = logits_BV.argmax(-1)
        else:
            greedy_B = _on(self.device, greedy)
            tokens_B = torch.where(greedy_B, logits_BV.argmax(-1), self._sample(logits_BV, reqs))
        return SampledTokens(tokens_B, self._logprobs(raw_logprobs_BV, tokens_B, num_lp), num_lp)

    def target_probs(self, logits_BV: torch.Tensor, reqs: List[SampleRequest]) -> torch.Tensor:
        """The distribution each row's token is drawn from by `sample` (penalties, min_tokens, temperature, top-k,
        top-p, min-p), normalised, float32; a greedy row is one-hot at its argmax. For speculative decoding's
        verification (moe_infer/engine/speculative/rejection.py), which needs the probabilities themselves."""
        logits_BV = self._apply_min_tokens(self._apply_penalties(logits_BV.float(), reqs), reqs)
        greedy = [r.params.is_greedy for r in reqs]
        one_hot_BV = torch.zeros_like(logits_BV).scatter_(1, logits_BV.argmax(-1, keepdim=True), 1.0)
        if all(greedy):
            return one_hot_BV
        temp_B1 = _on(self.device, [r.params.temperature if not r.params.is_greedy else 1.0 for r in reqs]).unsqueeze(1)
        probs_BV = self._filter(torch.softmax(logits_BV / temp_B1, -1), reqs)
        probs_BV = probs_BV / probs_BV.sum(-1, keepdim=True)
        return torch.where(_on(self.device, greedy).unsqueeze(1), one_hot_BV, probs_BV)

    def generator_of(self, req: SampleRequest) -> torch.Generator:
        """The generator a request's random draws come from: its own when seeded (made on first use), else the
        engine's."""
        if req.params.seed is None:
            return self.generator
        gen = self._seeded.get(req.seq_id)
        if gen is None:
            gen = self._seeded[req.seq_id] = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return gen

    # ------------------------------------------------------------------ logit processing
    def _apply_penalties(self, logits_BV: torch.Tensor, reqs: List[SampleRequest],
                         input_ids_B: Optional[torch.Tensor] = None) -> torch.Tensor:
        idx = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if not idx:
            return logits_BV
        rows, outs, prompts_rows, prompts, last_rows, last_of = [], [], [], [], [], []
        for j, i in enumerate(idx):
            r = reqs[i]
            if r.last_on_device:
                last_rows.append(j)
                last_of.append(i)
            hist = r.history if r.history is not None else []
            out_ids = hist[r.num_prompt_tokens:]
            rows += [j] * len(out_ids)
            outs += out_ids
            prompts_rows += [j] * r.num_prompt_tokens
            prompts += hist[:r.num_prompt_tokens]
        n, V = len(idx), logits_BV.shape[1]
        dev = self.device
        out_count_nV = torch.zeros(n, V, device=dev)
        if outs:
            out_count_nV.index_put_((_on(dev, rows), _on(dev, outs)),
                                    torch.ones(len(outs), device=dev), accumulate=True)
        if last_rows:  # the output token the host does not know yet
            out_count_nV.index_put_((_on(dev, last_rows), input_ids_B[_on(dev, last_of)]),
                                    torch.ones(len(last_rows), device=dev), accumulate=True)
        prompt_mask_nV = torch.zeros(n, V, dtype=torch.bool, device=dev)
        if prompts:
            prompt_mask_nV[_on(dev, prompts_rows), _on(dev, prompts)] = True
        ps = [reqs[i].params for i in idx]
        rep_n1 = _on(dev, [p.repetition_penalty for p in ps]).unsqueeze(1)
        pres_n1 = _on(dev, [p.presence_penalty for p in ps]).unsqueeze(1)
        freq_n1 = _on(dev, [p.frequency_penalty for p in ps]).unsqueeze(1)
        idx_t = _on(dev, idx)
        x_nV = logits_BV[idx_t]
        seen_nV = prompt_mask_nV | (out_count_nV > 0)
        x_nV = torch.where(seen_nV, torch.where(x_nV > 0, x_nV / rep_n1, x_nV * rep_n1), x_nV)
        x_nV = x_nV - freq_n1 * out_count_nV - pres_n1 * (out_count_nV > 0).float()
        logits_BV = logits_BV.clone()
        logits_BV[idx_t] = x_nV
        return logits_BV

    def _apply_min_tokens(self, logits_BV: torch.Tensor, reqs: List[SampleRequest]) -> torch.Tensor:
        rows, cols = [], []
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens:
                banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else self.eos_token_ids)
                rows += [i] * len(banned)
                cols += banned
        if not rows:
            return logits_BV
        logits_BV = logits_BV.clone()
        logits_BV[_on(self.device, rows), _on(self.device, cols)] = float("-inf")
        return logits_BV

    def _sample(self, logits_BV: torch.Tensor, reqs: List[SampleRequest]) -> torch.Tensor:
        dev = self.device
        temp_B1 = _on(dev, [r.params.temperature if not r.params.is_greedy else 1.0 for r in reqs]).unsqueeze(1)
        probs_BV = torch.softmax(logits_BV / temp_B1, -1)
        probs_BV = self._filter(probs_BV, reqs)
        q_BV = torch.empty_like(probs_BV).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):  # one noise row per seeded request, from its own generator
            if r.params.seed is not None and not r.params.is_greedy:
                gen = self._seeded.get(r.seq_id)
                if gen is None:
                    gen = self._seeded[r.seq_id] = torch.Generator(device=dev).manual_seed(r.params.seed)
                q_BV[i].exponential_(generator=gen)
        return (probs_BV / q_BV).argmax(-1)

    def _filter(self, probs_BV: torch.Tensor, reqs: List[SampleRequest]) -> torch.Tensor:
        """Zero the tokens outside top-k, outside the top-p nucleus and below min_p * p_max."""
        ps = [r.params for r in reqs]
        use_k = any(p.top_k != -1 for p in ps)
        use_p = any(p.top_p < 1.0 for p in ps)
        use_min_p = any(p.min_p > 0.0 for p in ps)
        dev, V = self.device, probs_BV.shape[1]
        if use_k or use_p:
            sorted_BV, order_BV = probs_BV.sort(-1, descending=True)
            remove_BV = torch.zeros_like(sorted_BV, dtype=torch.bool)
            if use_k:
                k_B1 = _on(dev, [min(p.top_k, V) if p.top_k != -1 else V for p in ps]).unsqueeze(1)  # k > V: all
                remove_BV |= torch.arange(V, device=dev).unsqueeze(0) >= k_B1
                sorted_BV = sorted_BV.masked_fill(remove_BV, 0.0)
            if use_p:  # nucleus of the (top-k renormalised) distribution; the top token always stays
                # rows without top-p never drop a token (cumsum rounding may pass 1.0 before the tail)
                top_p_B1 = _on(dev, [p.top_p if p.top_p < 1.0 else float("inf") for p in ps]).unsqueeze(1)
                renorm_BV = sorted_BV / sorted_BV.sum(-1, keepdim=True)
                mass_before_BV = renorm_BV.cumsum(-1) - renorm_BV
                remove_BV |= mass_before_BV >= top_p_B1
            probs_BV = probs_BV.scatter(1, order_BV, sorted_BV.masked_fill(remove_BV, 0.0))
        if use_min_p:
            min_p_B1 = _on(dev, [p.min_p for p in ps]).unsqueeze(1)
            probs_BV = probs_BV.masked_fill(probs_BV < min_p_B1 * probs_BV.max(-1, keepdim=True).values, 0.0)
        return probs_BV

    # ------------------------------------------------------------------ logprobs
    @staticmethod
    def _logprobs(logprobs_BV: Optional[torch.Tensor], tokens_B: torch.Tensor,
                  num_lp: List[Optional[int]]) -> Optional[List[torch.Tensor]]:
        """[chosen_B, rank_B, top_vals_BK, top_ids_BK] on the device (K: the most asked in the batch)."""
        if logprobs_BV is None:
            return None
        k = max(n for n in num_lp if n is not None)
        chosen_B = logprobs_BV.gather(1, tokens_B.unsqueeze(1)).squeeze(1)
        rank_B = (logprobs_BV > chosen_B.unsqueeze(1)).sum(-1) + 1
        top_vals_BK, top_ids_BK = logprobs_BV.topk(k, dim=-1) if k > 0 else (chosen_B[:, None][:, :0],) * 2
        return [chosen_B, rank_B, top_vals_BK, top_ids_BK.long()]
