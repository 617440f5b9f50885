"""`LLM`: the offline Python API, in vLLM's shape.

    llm = LLM(model=PATH, dtype="bfloat16", device="cuda", block_size=16, max_num_seqs=256)
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))

Keyword arguments are the fields of the EngineConfig groups (`block_size`, `max_num_seqs`,
`gpu_memory_utilization`, `enable_chunked_prefill`, `policy`, ...); a name two groups share is
written `<group>_<field>` (`routing_backend`, `experts_backend`), which also works for every field.
`offload="cpu"` (or "nvme") picks the expert store: `LLM(model=..., offload="cpu", gpu_expert_budget_gb=20)`.
`speculative_config={"method": "ngram", "num_speculative_tokens": 3}` turns speculative decoding on, as in vLLM
(docs/speculative.md).
A prompt of a shape the API does not take raises before any request starts (`check_prompts`); a request that
cannot run finishes alone with finish_reason "error" (reason in `.outputs[0].error`).
"""
from __future__ import annotations

import collections.abc
import dataclasses
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from moe_infer.config import EngineConfig, SpeculativeConfig
from moe_infer.engine.chat_template import ChatTemplateError, render_chat
from moe_infer.engine.encode import encode
from moe_infer.engine.llm_engine import LLMEngine, PromptType
from moe_infer.engine.outputs import RequestOutput
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.parallel.engine_hooks import serve

if TYPE_CHECKING:
    from moe_infer.routing.trace import RoutingTrace

_GROUPS = ("model", "cache", "scheduler", "routing", "experts", "offload", "parallel")
# LLM(model=PATH) is model.path, as in vLLM; LLM(offload="cpu") is offload.store
_ALIASES = {"model": ("model", "path"), "offload": ("offload", "store")}


def _field_map() -> Dict[str, Tuple[str, str]]:
    """kwarg name -> (group, field): unique field names, and `<group>_<field>` for all."""
    owners: Dict[str, List[str]] = {}
    for group in _GROUPS:
        for f in dataclasses.fields(EngineConfig.__dataclass_fields__[group].default_factory()):
            owners.setdefault(f.name, []).append(group)
    out = {f"{g}_{name}": (g, name) for name, groups in owners.items() for g in groups}
    out.update({name: (groups[0], name) for name, groups in owners.items() if len(groups) == 1})
    out.update(_ALIASES)
    return out


def build_speculative_config(value) -> SpeculativeConfig:
    """vLLM's `speculative_config`: a dict of SpeculativeConfig's fields ({"method": "ngram",
    "num_speculative_tokens": 3, ...}), a SpeculativeConfig, or None (off)."""
    if value is None:
        return SpeculativeConfig()
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict or a SpeculativeConfig, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}; known: {', '.join(sorted(known))}")
    return SpeculativeConfig(**value)


def build_config(model: Optional[str] = None, seed: int = 0, speculative_config=None, **kwargs) -> EngineConfig:
    fields = _field_map()
    per_group: Dict[str, dict] = {g: {} for g in _GROUPS}
    for key, value in {"model": model, **kwargs}.items():
        if key not in fields:
            raise TypeError(f"LLM() got an unknown argument {key!r}; known: {', '.join(sorted(fields))}")
        group, name = fields[key]
        per_group[group][name] = value
    parts = {g: type(EngineConfig.__dataclass_fields__[g].default_factory())(**v) for g, v in per_group.items()}
    return EngineConfig(seed=seed, speculative=build_speculative_config(speculative_config), **parts)


_PROMPT_SHAPES = ('a prompt is a str, {"prompt": str} or {"prompt_token_ids": [int, ...]} (token ids); '
                  '`prompts` is one prompt or a list of them')
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def check_prompts(prompts) -> List[PromptType]:
    """`generate`'s prompts as a list, or TypeError / ValueError before any request starts: a prompt of a type the
    API does not take, a prompt dict with both keys (which one runs?) or an unknown key (a typo, or another
    API's field). What a prompt holds (ids in the vocabulary, its length) is checked per request: that request
    fails alone."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, collections.abc.Iterable):
        raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}: "
                        f"{_PROMPT_SHAPES}")
    prompts = list(prompts)
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, dict):
            unknown = sorted(str(k) for k in prompt if k not in _PROMPT_KEYS)
            if unknown:
                raise ValueError(f"prompts[{i}] has unknown keys {unknown}: {_PROMPT_SHAPES}")
            if all(k in prompt for k in _PROMPT_KEYS):
                raise ValueError(f'prompts[{i}] has both "prompt" and "prompt_token_ids": give one '
                                 f"(text is tokenized, token ids run as they are)")
            if not prompt:
                raise ValueError(f"prompts[{i}] is an empty dict: {_PROMPT_SHAPES}")
        elif not isinstance(prompt, str):
            hint = " (token ids go in {'prompt_token_ids': [...]})" if isinstance(prompt, (list, tuple)) else ""
            raise TypeError(f"prompts[{i}] is of type {type(prompt).__name__}{hint}: {_PROMPT_SHAPES}")
    return prompts


class _ProgressBar:
    """vLLM's offline progress bar: finished requests, with input and output tokens/s so far."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.num_in = self.num_out = 0

    def update(self, out: RequestOutput) -> None:
        self.num_in += len(out.prompt_token_ids)
        self.num_out += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
        self.bar.set_postfix_str(f"est. speed input: {self.num_in / elapsed:.2f} toks/s, "
                                 f"output: {self.num_out / elapsed:.2f} toks/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class LLM:
    def __init__(self, model: Optional[str] = None, dtype: str = "auto", device: str = "auto",
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True, seed: int = 0,
                 **kwargs) -> None:
        cfg = build_config(model=model, dtype=dtype, device=device, block_size=block_size,
                           num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens,
                           enable_prefix_caching=enable_prefix_caching, seed=seed, **kwargs)
        self._init(cfg)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._init(cfg)
        return llm

    def _init(self, cfg: EngineConfig) -> None:
        path = cfg.model.path
        if path is None:
            from moe_infer.assets import default_model_path  # the embedded default checkpoint

            path = default_model_path()
        self.cfg = cfg
        self.engine = LLMEngine(cfg, str(path))

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True, stream: bool = False):
        """One RequestOutput per prompt, in order (stream=True: the generator of generate_stream)."""
        if stream:
            return self.generate_stream(prompts, sampling_params)
        if not self.engine.parallel.is_driver:  # under a mesh: run the driver's steps, return its outputs
            return serve(self.engine.parallel, self.engine.runner)
        prompts, params = self._normalize(prompts, sampling_params)
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages, sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict] = None) -> List[RequestOutput]:
        """vLLM's chat: one conversation (a list of {"role", "content"} messages) or a list of conversations,
        each through the tokenizer's chat template (or `chat_template`, a Jinja string) and generated as by
        `generate`; one RequestOutput per conversation, its `prompt` the templated text. A malformed message or
        a tokenizer without a template raises ValueError (moe_infer/engine/chat_template.py) before any request
        starts."""
        if not self.engine.parallel.is_driver:  # under a mesh: run the driver's steps, return its outputs
            return serve(self.engine.parallel, self.engine.runner)
        is_batch = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(m, (list, tuple)) for m in messages)
        conversations = list(messages) if is_batch else [messages]
        tok = self.engine.tokenizer
        prompts: List[PromptType] = []
        for i, conversation in enumerate(conversations):
            try:
                text = render_chat(tok, conversation, chat_template, add_generation_prompt,
                                   **(chat_template_kwargs or {}))
            except ChatTemplateError as err:
                raise ChatTemplateError(f"conversation {i}: {err}" if is_batch else str(err)) from None
            prompts.append({"prompt_token_ids": encode(tok, text, add_special_tokens=False),
                            "prompt": text})  # the engine's own form: ids run, text reported
        return self._run(prompts, self._params(sampling_params, len(prompts), "conversations"), use_tqdm)

    def _run(self, prompts: List[PromptType], params: List[SamplingParams], use_tqdm: bool) -> List[RequestOutput]:
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: Dict[str, RequestOutput] = {}
        bar = _ProgressBar(len(ids)) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(final_only=True):
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(out)
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:  # an interrupted generate leaves nothing behind
                if rid not in final:
                    self.engine.abort_request(rid)
        return self.engine.executor.finish([final[rid] for rid in ids])

    def generate_stream(self, prompts: Union[PromptType, Sequence[PromptType]],
                        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None
                        ) -> Iterator[RequestOutput]:
        """Yields a RequestOutput (cumulative text and tokens so far) each time a request advances."""
        if not self.engine.parallel.is_driver:  # under a mesh: run the driver's steps
            serve(self.engine.parallel, self.engine.runner)
            return
        prompts, params = self._normalize(prompts, sampling_params)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        pending = set(ids)
        try:
            while pending and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:
                self.engine.abort_request(rid)
            while not self.engine.requests and self.engine.has_unfinished_requests():
                self.engine.step()  # async scheduling: collect the step still in flight (its blocks come back)
            self.engine.executor.finish([])

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _normalize(prompts, sampling_params) -> Tuple[List[PromptType], List[SamplingParams]]:
        prompts = check_prompts(prompts)
        return prompts, LLM._params(sampling_params, len(prompts))

    @staticmethod
    def _params(sampling_params, num_prompts: int, what: str = "prompts") -> List[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(f"{len(params)} sampling params for {num_prompts} {what}: pass one, or one per "
                             f"{what[:-1]}")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be SamplingParams objects")
        return params

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_expert_load(self) -> List[dict]:
        """Per MoE layer: rows routed / dropped / rerouted per expert, imbalance, entropy.

        Rows the layer computed: with `model.prune_last_layer` (the default) the model's last layer runs, in a
        step with prompt tokens, each sequence's last token only, so it counts those. Empty when the statistics
        are off (`routing.collect_stats=False`).
        """
        return self.engine.get_expert_load()

    def get_offload_stats(self) -> dict:
        """Offload stores: the plan, the measured cost model, and per layer and in total the hit rate,
        where misses went (copied, streamed, CPU), bytes moved and prefetch accuracy. {} when resident."""
        offload = self.engine.runner.offload
        return offload.summary() if offload is not None else {}

    def reset_offload_stats(self) -> None:
        if self.engine.runner.offload is not None:
            self.engine.runner.offload.reset_stats()

    def reset_expert_load(self) -> None:
        self.engine.runner.reset_stats()

    def get_routing_trace(self, **info) -> "RoutingTrace":
        """Every token's routed experts and weights since the start or the last reset (`routing.trace=true`).

        info: free-form metadata stored with the trace (prompts, notes); model, policy, dtype, device
        and the code's commit are filled in.
        """
        from moe_infer.routing.trace import source_commit

        recorder = self.engine.runner.trace
        if recorder is None:
            raise RuntimeError("routing traces are off: build the LLM with routing_trace=True "
                               "(Hydra: routing.trace=true or trace_out=PATH)")
        r = self.cfg.routing
        meta = {"model": str(self.cfg.model.path or "tiny_moe (embedded)"), "dtype": str(self.engine.dtype),
                "device": str(self.engine.device), "commit": source_commit(), "source": "moe_infer engine",
                "policy": {"policy": r.policy, "capacity_factor": r.capacity_factor,
                           "min_capacity": r.min_capacity, "drop_by": r.drop_by}}
        meta.update(info)
        return recorder.trace(meta)

    def save_routing_trace(self, path: str, **info) -> "RoutingTrace":
        """Write `get_routing_trace(**info)` to `path` (format: moe_infer/routing/trace.py)."""
        from moe_infer.routing.trace import save_trace

        trace = self.get_routing_trace(**info)
        save_trace(trace, path)
        return trace

    def reset_routing_trace(self) -> None:
        if self.engine.runner.trace is not None:
            self.engine.runner.trace.reset()

    def shutdown(self) -> None:
        """Under torchrun: wait for every rank, then tear the process groups down (no-op on one rank).

        Optional (done at exit otherwise). Call once, after the last `generate` of the process; the
        process group is shared by every LLM of the process, so no LLM can run collectives afterwards.
        """
        if self.engine.runner.offload is not None:  # NVMe files deleted, pinned host memory unlocked
            self.engine.runner.offload.close()
        self.engine.parallel.shutdown()
