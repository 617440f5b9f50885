"""SamplingParams: vLLM's names and defaults, validated when built (a bad field raises ValueError naming it).

Types are checked before ranges: a float field takes a finite real number (nan compares false to every bound,
so it slipped past them: temperature=nan sampled nothing), an int field an int (not a bool, a float or a
string), a flag a bool. numpy scalars pass and are stored as Python numbers.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import List, Optional, Union

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("n", "top_k", "min_tokens")
_OPTIONAL_INTS = ("seed", "max_tokens", "logprobs")
_FLAGS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1  # independent samples of the prompt; with a seed, sample i uses seed + i (request_state.py)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # -1 = all tokens
    min_p: float = 0.0  # drop tokens with p < min_p * p_max
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (CTRL rule)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: Optional[int] = None  # per-request generator: same seed -> same tokens, alone or in a batch
    stop: Optional[Union[str, List[str]]] = None  # stop strings (need a tokenizer); not in the text
    stop_token_ids: Optional[List[int]] = None  # extra stop tokens (kept in token_ids, as EOS is)
    max_tokens: Optional[int] = 16  # None: until max_model_len
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-k logprobs per generated token (plus the chosen token's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_strings: List[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._check_types()
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"SamplingParams.min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"SamplingParams.logprobs must be >= 0, got {self.logprobs}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        self.stop_strings = stop
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or t < 0 for t in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in ids]

    def _check_types(self) -> None:
        """Every number field of the right type (numpy scalars become Python numbers), before any range check."""
        for name in _FLOATS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        for name in _INTS + _OPTIONAL_INTS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INTS:
                continue
            if not _is_int(value):
                kind = "an int or None" if name in _OPTIONAL_INTS else "an int"
                raise ValueError(f"SamplingParams.{name} must be {kind}, got {value!r} ({type(value).__name__})")
            setattr(self, name, int(value))
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
