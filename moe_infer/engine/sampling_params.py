"""SamplingParams: vLLM's names and defaults, validated when built (a bad field raises ValueError naming it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union


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
        if not isinstance(self.n, int) or self.n < 1:
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
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        self.stop_strings = stop
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
