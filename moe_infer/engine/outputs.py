"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput shape, plus per-request metrics."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: Optional[str] = None


@dataclass
class RequestMetrics:
    arrival_time: float
    time_to_first_token: Optional[float] = None  # seconds from arrival to the first generated token
    time_per_output_token: Optional[float] = None  # mean seconds between later tokens
    e2e_latency: Optional[float] = None  # arrival to finish
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache at the last admission (sum over n)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    logprobs: Optional[List[Dict[int, Logprob]]] = None  # per generated token: top-k + the chosen one
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None  # stop | length | abort | error; None while running
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it
    error: Optional[str] = None  # why, when finish_reason == "error"

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
