"""The engine: requests in, RequestOutputs out; one `step()` is schedule -> run -> postprocess.

Usable directly by a server: `add_request`, `abort_request`, `step`, `has_unfinished_requests`.
A request that cannot run (malformed prompt, token ids outside the vocabulary, prompt too long for
the model or the KV cache) finishes alone with finish_reason "error" and the reason in
`outputs[0].error`; a step whose forward raises fails only the requests of that step.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Dict, List, Optional, Union

import torch

from moe_infer.config import EngineConfig
from moe_infer.engine.block_manager import BlockManager
from moe_infer.engine.detokenizer import IncrementalDetokenizer
from moe_infer.engine.model_runner import ModelRunner
from moe_infer.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.engine.scheduler import Scheduler
from moe_infer.engine.sequence import Sequence
from moe_infer.parallel.engine_hooks import init_engine_parallel, run_step

logger = logging.getLogger(__name__)

PromptType = Union[str, Dict[str, Union[str, List[int]]]]  # "text", {"prompt": "text"}, {"prompt_token_ids": [...]}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={name!r} but CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when the folder has no tokenizer files."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class _Request:
    """Engine-side state of one request: its sequence, detokenizer and accumulated logprobs."""

    def __init__(self, seq: Sequence, detok: Optional[IncrementalDetokenizer]) -> None:
        self.seq, self.detok = seq, detok
        self.logprobs: Optional[List[Dict[int, Logprob]]] = [] if seq.params.logprobs is not None else None
        self.cumulative_logprob = 0.0


class LLMEngine:
    def __init__(self, cfg: EngineConfig, model_path: str) -> None:
        self.cfg = cfg
        self.parallel = init_engine_parallel(cfg)  # EP process group first: it picks this rank's GPU
        self.device = resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        torch.manual_seed(cfg.seed)
        self.runner = ModelRunner(cfg, model_path, self.device, self.dtype, parallel=self.parallel)
        self.tokenizer = load_tokenizer(model_path)
        arch = self.runner.arch
        self.vocab_size = arch.vocab_size
        self.block_manager = BlockManager(self.runner.num_kv_blocks, cfg.cache.block_size,
                                          cfg.cache.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens,
            self.runner.max_model_len, cfg.scheduler.enable_chunked_prefill, arch.eos_token_ids,
        )
        self.requests: Dict[str, _Request] = {}
        self._by_seq: Dict[int, _Request] = {}
        self._ids = itertools.count()
        self._pending: List[RequestOutput] = []  # outputs of requests that failed at admission

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None) -> str:
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids, error = self._tokenize(prompt, params)
        seq = Sequence(request_id, token_ids, params, prompt=text)
        detok = (IncrementalDetokenizer(self.tokenizer, token_ids, params.stop_strings, params.skip_special_tokens,
                                        params.include_stop_str_in_output) if self.tokenizer is not None else None)
        req = self.requests[request_id] = self._by_seq[seq.seq_id] = _Request(seq, detok)
        if error is None:
            self.scheduler.add(seq)  # finishes seq with an error when it can never run
        else:
            seq.finish("error", error=error)
        if seq.is_finished:
            logger.warning("request %s rejected: %s", request_id, seq.error)
            self._pending.append(self._output(req))
            self._drop(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self.scheduler.abort(req.seq)
            self._pending.append(self._output(req))
            self._drop(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self, final_only: bool = False) -> List[RequestOutput]:
        """One step; returns the outputs of requests that progressed or finished in it (final_only: of the
        finished ones only, as vLLM's offline generate does: an output copies the request's token lists,
        and building one per request per step is wasted work when only the final one is read)."""
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.runner.sampler.forget(plan.finished_seq_ids)
            return outputs
        now = time.monotonic()
        for item in plan.seqs:
            req = self._by_seq_id(item.seq_id)
            if req.seq.metrics.first_scheduled_time is None:
                req.seq.metrics.first_scheduled_time = now
        try:
            tokens, logprobs = run_step(self.parallel, self.runner, plan)  # EP: the plan goes to every rank
        except Exception as err:  # the step's requests fail; the engine and the other requests go on
            logger.exception("forward failed for %d requests", len(plan.seqs))
            for item in plan.seqs:
                req = self._by_seq_id(item.seq_id)
                self.scheduler.finish(req.seq, "error", error=f"{type(err).__name__}: {err}")
                outputs.append(self._output(req))
                self._drop(req)
            return outputs
        lp_by_seq = {item.seq_id: lp for item, lp in zip(plan.seqs, logprobs) if lp is not None}
        updated = self.scheduler.postprocess(plan, tokens)
        now = time.monotonic()
        for seq in updated:
            req = self._by_seq[seq.seq_id]
            m = seq.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            token = seq.token_ids[-1]
            if seq.seq_id in lp_by_seq:
                self._add_logprobs(req, token, lp_by_seq[seq.seq_id])
            if req.detok is not None:
                _, stop = req.detok.add_token(token)
                if stop is not None and not seq.is_finished:
                    self.scheduler.finish(seq, "stop", stop)
            if seq.is_finished or not final_only:
                outputs.append(self._output(req))
            if seq.is_finished:
                self._drop(req)
        return outputs

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, prompt: PromptType, params: SamplingParams):
        """(prompt text, token ids, error or None) of a prompt."""
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            return None, [], f"logprobs={params.logprobs} exceeds the vocabulary size {self.vocab_size}"
        if params.stop_strings and self.tokenizer is None:
            return None, [], "stop strings need a tokenizer, and this checkpoint has none"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return prompt, [], ("a text prompt needs a tokenizer, and this checkpoint folder has none: "
                                    "pass {'prompt_token_ids': [...]} instead")
            return prompt, list(self.tokenizer(prompt)["input_ids"]), None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                return text, [], f"prompt_token_ids must be a list of ints, got {type(ids).__name__}"
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                return text, [], f"prompt_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            if text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(ids)
            return text, list(ids), None
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
            return self._tokenize(prompt["prompt"], params)
        return None, [], ("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [...]}, got "
                          f"{type(prompt).__name__}{' with keys ' + str(sorted(prompt)) if isinstance(prompt, dict) else ''}")

    def _by_seq_id(self, seq_id: int) -> _Request:
        return self._by_seq[seq_id]

    def _drop(self, req: _Request) -> None:
        del self.requests[req.seq.request_id], self._by_seq[req.seq.seq_id]

    def _add_logprobs(self, req: _Request, token: int, lp: tuple) -> None:
        chosen, rank, top_ids, top_vals = lp
        entry = {t: Logprob(v, r + 1, self._decode_one(t)) for r, (t, v) in enumerate(zip(top_ids, top_vals))}
        entry.setdefault(token, Logprob(chosen, rank, self._decode_one(token)))
        req.cumulative_logprob += chosen
        req.logprobs.append(entry)

    def _decode_one(self, token: int) -> Optional[str]:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    @staticmethod
    def _text(req: _Request) -> str:
        if req.detok is None:
            return ""
        return req.detok.text if req.seq.is_finished else req.detok.stable_text

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        m = seq.metrics
        n_out = seq.num_output_tokens
        metrics = RequestMetrics(
            arrival_time=m.arrival_time,
            time_to_first_token=None if m.first_token_time is None else m.first_token_time - m.arrival_time,
            time_per_output_token=((m.last_token_time - m.first_token_time) / (n_out - 1)
                                   if n_out > 1 and m.first_token_time is not None else None),
            e2e_latency=None if m.finished_time is None else m.finished_time - m.arrival_time,
            num_preemptions=m.num_preemptions, num_cached_prompt_tokens=seq.num_cached_tokens,
        )
        completion = CompletionOutput(
            index=0, text=self._text(req), token_ids=list(seq.output_token_ids),
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, error=seq.error,
        )
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion],
                             finished=seq.is_finished, metrics=metrics, num_cached_tokens=seq.num_cached_tokens)
