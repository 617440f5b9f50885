"""The engine: requests in, RequestOutputs out; one `step()` is schedule -> run -> postprocess.

Usable directly by a server: `add_request`, `abort_request`, `step`, `has_unfinished_requests`,
`check_prompt` (the admission checks, for a server to answer 400 before adding), `get_stats`.
A request that cannot run (malformed prompt, token ids outside the vocabulary, prompt too long for
the model or the KV cache) finishes alone with finish_reason "error" and the reason in
`outputs[i].error`; a step whose forward raises fails only the requests of that step. A request with
`SamplingParams.n > 1` runs as n sequences (moe_infer/engine/request_state.py).

With async scheduling (`scheduler.async_scheduling`, on by default where it applies: see
moe_infer/engine/async_scheduling.py) a `step()` launches the next step before it postprocesses the
one in flight, so it returns the outputs of the step launched by the call before it; the first call
returns none, and `has_unfinished_requests()` stays true until the last step in flight is collected.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from moe_infer.config import EngineConfig
from moe_infer.engine.async_scheduling import AsyncStepExecutor, async_scheduling_blocker
from moe_infer.engine.block_manager import BlockManager
from moe_infer.engine.dp_scheduler import DPScheduler
from moe_infer.engine.encode import encode
from moe_infer.engine.engine_stats import EngineStats
from moe_infer.engine.model_runner import ModelRunner
from moe_infer.engine.outputs import RequestOutput
from moe_infer.engine.prompt_limits import int_ids
from moe_infer.engine.request_state import Child, RequestState
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.engine.scheduler import Scheduler
from moe_infer.engine.sequence import SchedulerOutput
from moe_infer.engine.speculative.speculator import Speculator, speculation_blocker
from moe_infer.engine.startup_timings import StartupTimings
from moe_infer.parallel.engine_hooks import init_engine_parallel, make_executor
from moe_infer.parallel.pipeline import StepFailed

if TYPE_CHECKING:
    from moe_infer.engine.output_delta import DeltaEncoder

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


class LLMEngine:
    def __init__(self, cfg: EngineConfig, model_path: str, detokenize: bool = True) -> None:
        """detokenize=False: outputs carry token ids only (empty text, logprob entries without decoded
        tokens) and stop strings are not checked here; whoever reads the outputs detokenizes and ends a
        sample on its stop string with `stop_sample` (the engine core process: the server's process does it,
        moe_infer/engine/detok_assembler.py)."""
        started = time.perf_counter()
        self.cfg = cfg
        self.detokenize = detokenize
        speculation_blocker(cfg)  # before any process group: a mesh with speculation is refused at once
        timings = StartupTimings()  # where start-up goes (moe_infer/engine/startup_timings.py)
        with timings.part("parallel_init_s"):
            self.parallel = init_engine_parallel(cfg, model_path)  # the mesh first: it picks this rank's GPU
            self.device = resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        if self.device.type == "cuda":
            with timings.part("cuda_init_s"):  # the context now, not inside the first part that touches the GPU
                torch.zeros(1, device=self.device)
        torch.manual_seed(cfg.seed)
        kv_reserve, spec = (0, 0), cfg.speculative
        if spec.method == "draft" and spec.draft_model and os.path.isdir(spec.draft_model):
            from moe_infer.engine.speculative.draft import draft_reserve

            kv_reserve = draft_reserve(spec.draft_model, cfg, self.dtype)
        elif spec.method == "mtp":  # the MTP layer's own KV cache, under the same block ids (its weights: loaded)
            from moe_infer.engine.speculative.mtp import mtp_kv_bytes_per_block

            kv_reserve = (mtp_kv_bytes_per_block(model_path, cfg.cache.block_size, self.dtype), 0)
        self.runner = ModelRunner(cfg, model_path, self.device, self.dtype, parallel=self.parallel,
                                  kv_reserve=kv_reserve)
        self.startup_timings = timings
        timings.update(self.runner.startup_timings)
        with timings.part("tokenizer_s"):
            self.tokenizer = load_tokenizer(model_path)
        scheduler_start = time.perf_counter()
        arch = self.runner.arch
        self.vocab_size = arch.vocab_size
        self.max_model_len = self.runner.max_model_len
        why_sync = async_scheduling_blocker(cfg, self.parallel)
        if why_sync is not None and cfg.scheduler.async_scheduling:
            logger.info("steps run synchronously (no async scheduling): %s", why_sync)
        sched_kwargs = dict(max_num_seqs=cfg.scheduler.max_num_seqs,
                            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                            max_model_len=self.runner.max_model_len,
                            enable_chunked_prefill=cfg.scheduler.enable_chunked_prefill,
                            eos_token_ids=arch.eos_token_ids,
                            num_batches=self.parallel.dims.pp,  # pipeline stages: pp batches in flight
                            lookahead=why_sync is None)
        if self.parallel.dims.num_replicas > 1:  # attention data parallelism: a scheduler and KV cache a replica
            self.scheduler = DPScheduler(self.parallel.dims.num_replicas, self.runner.num_kv_blocks,
                                         cfg.cache.block_size, cfg.cache.enable_prefix_caching, **sched_kwargs)
            self.block_manager = self.scheduler.block_manager
        else:
            self.block_manager = BlockManager(self.runner.num_kv_blocks, cfg.cache.block_size,
                                              cfg.cache.enable_prefix_caching)
            self.scheduler = Scheduler(self.block_manager, **sched_kwargs)
        self.limits = replace(self.scheduler.limits, vocab_size=self.vocab_size,
                              has_tokenizer=self.tokenizer is not None)
        if self.parallel.is_distributed:  # the driver's executor (moe_infer/parallel/pipeline.py)
            self.executor = make_executor(self.parallel, self.runner, lookahead=why_sync is None)
        else:
            self.executor = AsyncStepExecutor(self.runner) if why_sync is None else make_executor(self.parallel, self.runner)
        self.speculator: Optional[Speculator] = None  # speculative decoding (moe_infer/engine/speculative/)
        if cfg.speculative.enabled:
            self.speculator = Speculator(cfg, self.runner, self.block_manager, self.max_model_len,
                                         lookahead=isinstance(self.executor, AsyncStepExecutor))
        self.requests: Dict[str, RequestState] = {}
        self._by_seq: Dict[int, Tuple[RequestState, Child]] = {}
        self._ids = itertools.count()
        self._pending: List[RequestOutput] = []  # outputs of requests that finished outside a step
        timings["scheduler_s"] = time.perf_counter() - scheduler_start
        total = time.perf_counter() - started
        logger.info("engine started in %.1f s: %s, other %.2f s", total, timings.summary(),
                    total - sum(timings.values()))

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None) -> str:
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids, error = self._tokenize(prompt, params)
        req = self.requests[request_id] = RequestState(request_id, text, token_ids, params,
                                                       self.tokenizer if self.detokenize else None)
        for child in req.children:
            self._by_seq[child.seq.seq_id] = (req, child)
            if error is None:
                self.scheduler.add(child.seq)  # finishes the seq with an error when it can never run
            else:
                child.seq.finish("error", error=error)
        if req.is_finished:
            logger.warning("request %s rejected: %s", request_id, req.children[0].seq.error)
            self._pending.append(req.output())
            self._drop(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Finish the request (all its samples) with finish_reason "abort"; its blocks are free at once."""
        req = self.requests.get(request_id)
        if req is not None:
            for seq in req.seqs:
                self.scheduler.abort(seq)
            self._pending.append(req.output())
            self._drop(req)

    def stop_sample(self, request_id: str, index: int, stop: str) -> None:
        """End sample `index` of a request with finish_reason "stop" (its stop string, found by the reader of
        undetokenized outputs); its blocks are free once no step in flight uses them. A finished sample or
        request is left as it is."""
        req = self.requests.get(request_id)
        if req is not None and 0 <= index < len(req.children) and not req.children[index].seq.is_finished:
            self.scheduler.finish(req.children[index].seq, "stop", stop)
            if req.is_finished:
                self._pending.append(req.output())
                self._drop(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    def check_prompt(self, token_ids: List[int], params: SamplingParams) -> Optional[str]:
        """Why add_request would reject these prompt ids with params (None: they can run)."""
        return self.limits.check(token_ids, params)

    def get_stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        stats = EngineStats(len(self.requests), len(sch.running), len(sch.waiting), bm.num_blocks,
                            bm.num_free_blocks, bm.num_prefix_queries, bm.num_prefix_hits, sch.num_preemptions)
        spec = self.speculator
        if spec is not None:
            stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens = spec.num_proposed, spec.num_accepted
            stats.num_spec_verified = spec.num_verified
        return stats

    def get_expert_load(self) -> List[dict]:
        """Per MoE layer: rows routed / dropped / rerouted per expert, imbalance, entropy (one host sync).

        Empty when the statistics are off (`routing.collect_stats=False`).
        """
        stats = self.runner.stats
        if stats is None:
            return []
        moe_layers = set(self.runner.arch.moe_layer_ids)
        return [row for row in stats.summary() if row["layer"] in moe_layers]

    # ------------------------------------------------------------------ the step
    def step(self, final_only: bool = False, encoder: Optional["DeltaEncoder"] = None) -> list:
        """One step; returns the outputs of requests that progressed or finished in it (final_only: of the
        finished ones only, as vLLM's offline generate does: an output copies the request's token lists,
        and building one per request per step is wasted work when only the final one is read).
        encoder (a DeltaEncoder, moe_infer/engine/output_delta.py): the outputs as the deltas an engine core
        process sends, built from the requests' state without building their cumulative outputs."""
        outputs, self._pending = self._pending, []
        if encoder is not None:
            outputs = [encoder.encode(out) for out in outputs]
        spec = self.speculator
        if spec is not None:
            in_flight = getattr(self.executor, "in_flight", None)  # async scheduling: the step launched before
            spec.begin_step(in_flight is not None)
            if in_flight is not None and spec.must_drain(self.scheduler.running, in_flight.plan):
                # a verify step is scheduled with every token on the host, and collected before the next step
                self._run(SchedulerOutput(), outputs, final_only, encoder)
            spec.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        now = time.monotonic()
        for item in plan.seqs:
            seq = self._by_seq[item.seq_id][1].seq
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        if spec is not None and not plan.is_empty:
            spec.launched(plan, behind=getattr(self.executor, "in_flight", None) is not None)
        self._run(plan, outputs, final_only, encoder)
        if spec is not None and spec.lookahead and any(item.spec_token_ids for item in plan.seqs):
            self._run(SchedulerOutput(), outputs, final_only, encoder)  # the verify step, collected now
        return outputs

    def _run(self, plan: SchedulerOutput, outputs: list, final_only: bool,
             encoder: Optional["DeltaEncoder"]) -> None:
        """Runs plan through the executor and postprocesses the step it returns (with async scheduling: the step
        launched before; an empty plan only collects it), appending the requests' outputs to outputs."""
        try:  # under a mesh the plan goes to every rank; with pipeline stages an earlier batch may come back
            done = self.executor.run(plan)
        except StepFailed as failed:  # the step's requests fail; the engine and the other requests go on
            logger.error("forward failed for %d sequences: %s", len(failed.plan.seqs), failed, exc_info=failed.cause)
            entries = (self._by_seq.get(item.seq_id) for item in failed.plan.seqs)
            failed_reqs = {id(e[0]): e[0] for e in entries if e is not None}  # None: aborted while in flight
            for req in failed_reqs.values():
                for seq in req.seqs:
                    if not seq.is_finished:
                        self.scheduler.finish(seq, "error", error=str(failed))
                outputs.append(req.output() if encoder is None else encoder.encode_request(req))
                self._drop(req)
            self.scheduler.discard(failed.plan)  # never postprocessed: its finished sequences' blocks come back
            if self.speculator is not None:
                self.speculator.dropped(failed.plan)
            return
        if done is None:
            return
        plan, tokens, logprobs = done
        lp_by_seq = {item.seq_id: lp for item, lp in zip(plan.seqs, logprobs) if lp is not None}
        updated = self.scheduler.postprocess(plan, tokens)
        if self.speculator is not None:
            self.speculator.record(plan, tokens)
        now = time.monotonic()
        progressed: Dict[str, RequestState] = {}
        for seq in updated:
            req, child = self._by_seq[seq.seq_id]
            m = seq.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            if isinstance(lp_by_seq.get(seq.seq_id, ()), list) or seq.num_new_tokens > 1:  # a verify step's tokens
                self._take_tokens(seq, child, lp_by_seq.get(seq.seq_id))
                progressed[req.request_id] = req
                continue
            token = seq.token_ids[-1]
            if seq.seq_id in lp_by_seq:
                child.add_logprobs(token, lp_by_seq[seq.seq_id], self._decode_one)
            if child.detok is not None:
                _, stop = child.detok.add_token(token)
                if stop is not None and not seq.is_finished:
                    self.scheduler.finish(seq, "stop", stop)
                elif seq.is_finished and stop is None:  # the last token: what was held back is the text's end
                    _, stop = child.detok.flush()
                    if stop is not None and seq.finish_reason == "length":
                        seq.finish_reason, seq.stop_reason = "stop", stop
            progressed[req.request_id] = req
        for req in progressed.values():
            finished = req.is_finished
            if encoder is not None:
                outputs.append(encoder.encode_request(req))
            elif finished or not final_only:
                outputs.append(req.output())
            if finished:
                self._drop(req)

    # ------------------------------------------------------------------ helpers
    def _take_tokens(self, seq, child: Child, lps: Optional[list]) -> None:
        """The tokens a verify step appended to seq (speculative decoding), one at a time as a plain step's: logprobs,
        detokenizing; a stop string cuts the tokens after the one that completed it."""
        n = seq.num_new_tokens
        first = len(seq) - n
        for i in range(n):
            token = seq.token_ids[first + i]
            if lps is not None:
                child.add_logprobs(token, lps[i], self._decode_one)
            if child.detok is None:
                continue
            _, stop = child.detok.add_token(token)
            if stop is not None and not seq.is_finished:
                del seq.token_ids[first + i + 1:]  # tokens past the stop string are not output
                self.scheduler.finish(seq, "stop", stop)
                return
            if stop is not None and i < n - 1:  # finished by a later token (length, a stop token): cut there
                del seq.token_ids[first + i + 1:]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        if seq.is_finished and child.detok is not None:  # the last token: what was held back is the text's end
            _, stop = child.detok.flush()
            if stop is not None and seq.finish_reason == "length":
                seq.finish_reason, seq.stop_reason = "stop", stop

    def _tokenize(self, prompt: PromptType, params: SamplingParams):
        """(prompt text, token ids, error or None) of a prompt."""
        error = self.limits.params_error(params)
        if error is not None:
            return None, [], error
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return prompt, [], ("a text prompt needs a tokenizer, and this checkpoint folder has none: "
                                    "pass {'prompt_token_ids': [...]} instead")
            return prompt, encode(self.tokenizer, prompt), None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
            ids_L = int_ids(ids) if isinstance(ids, (list, tuple)) else None  # None: not all ints
            if ids_L is None:
                return text, [], f"prompt_token_ids must be a list of ints, got {type(ids).__name__}"
            error = self.limits.ids_error(ids_L)
            if error is not None:
                return text, [], error
            # text None: as vLLM, a prompt given as ids is not decoded to text on the request's way in (a 1,024-id
            # prompt's decode was most of add_request's time); the server decodes it where echo needs it
            # an int64 array goes on to the sequence as it is (prompt chunks read it: Sequence.prompt_array)
            return text, ids_L if ids_L.dtype == np.int64 else ids_L.tolist(), None
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
            return self._tokenize(prompt["prompt"], params)
        return None, [], ("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [...]}, got "
                          f"{type(prompt).__name__}{' with keys ' + str(sorted(prompt)) if isinstance(prompt, dict) else ''}")

    def _drop(self, req: RequestState) -> None:
        del self.requests[req.request_id]
        for seq in req.seqs:
            del self._by_seq[seq.seq_id]

    def _decode_one(self, token: int) -> Optional[str]:
        return self.tokenizer.decode([token]) if self.tokenizer is not None and self.detokenize else None
