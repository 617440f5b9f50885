"""PromptLimits: what a prompt must satisfy to run on an engine, as plain numbers.

The scheduler answers `length_error` when a sequence is queued (a prompt that can never run finishes
with an error instead of waiting forever); the engine adds the vocabulary and tokenizer checks. Being
plain numbers, the limits travel to a server's HTTP process, which answers 400 before a request reaches
an engine that runs in another process (moe_infer/engine/core_proc.py).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np

from moe_infer.engine.sampling_params import SamplingParams


def int_ids(ids: Sequence) -> Optional[np.ndarray]:
    """A prompt's token ids as a 1-D array when every one is an int (numpy's integer scalars included), else
    None. The usual list of Python ints converts at C speed to an int64 array (through array('q'), which takes
    ints only and, unlike np.asarray, infers no dtype first: about half the time for 1,024 ids); anything else is
    checked one by one and, if they pass (bools count as ints, as for isinstance), kept as Python objects."""
    try:
        return np.frombuffer(array("q", ids), dtype=np.int64)
    except (ValueError, TypeError, OverflowError):
        pass
    try:
        ids_L = np.asarray(ids)
    except (ValueError, TypeError, OverflowError):
        ids_L = None
    if ids_L is not None and ids_L.ndim == 1 and ids_L.dtype.kind in "iu":
        return ids_L
    if all(isinstance(t, int) for t in ids):
        out_L = np.empty(len(ids), dtype=object)
        out_L[:] = list(ids)
        return out_L
    return None


@dataclass(frozen=True)
class PromptLimits:
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: Optional[int]  # the longest prompt one step takes; None: chunked prefill (no limit)
    vocab_size: Optional[int] = None  # None: ids are not checked (the scheduler's own limits)
    has_tokenizer: bool = True

    def length_error(self, num_tokens: int) -> Optional[str]:
        """Why a prompt of num_tokens can never run here (None: it can)."""
        if num_tokens == 0:
            return "the prompt is empty"
        if num_tokens > self.max_model_len - 1:
            return (f"prompt of {num_tokens} tokens is too long: max_model_len is {self.max_model_len} "
                    f"and at least one token must be generated")
        if -(-(num_tokens + 1) // self.block_size) > self.num_kv_blocks:  # its blocks and the first new token's
            return self.kv_overflow(num_tokens)
        if self.max_num_batched_tokens is not None and num_tokens > self.max_num_batched_tokens:
            return (f"prompt of {num_tokens} tokens exceeds max_num_batched_tokens="
                    f"{self.max_num_batched_tokens} and chunked prefill is off")
        return None

    def kv_overflow(self, num_tokens: int) -> str:
        return (f"prompt of {num_tokens} tokens can never fit in the KV cache: it holds {self.num_kv_blocks} "
                f"blocks x {self.block_size} tokens = {self.num_kv_blocks * self.block_size} tokens")

    def params_error(self, params: SamplingParams) -> Optional[str]:
        if self.vocab_size is not None and params.logprobs is not None and params.logprobs > self.vocab_size:
            return f"logprobs={params.logprobs} exceeds the vocabulary size {self.vocab_size}"
        if params.stop_strings and not self.has_tokenizer:
            return "stop strings need a tokenizer, and this checkpoint has none"
        if self.vocab_size is not None:
            bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
            if bad:
                return f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
        return None

    def ids_error(self, ids: Union[Sequence[int], np.ndarray]) -> Optional[str]:
        if self.vocab_size is None:
            return None
        if isinstance(ids, np.ndarray):  # `int_ids`: checked at C speed (a prompt's ids delay its first token)
            bad: List[int] = ids[((ids < 0) | (ids >= self.vocab_size)).astype(bool)][:5].tolist()
        else:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
        return f"prompt_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})" if bad else None

    def check(self, ids: Sequence[int], params: SamplingParams) -> Optional[str]:
        """Why add_request would reject these prompt ids with params (None: they can run)."""
        return self.params_error(params) or self.ids_error(ids) or self.length_error(len(ids))
