"""`EngineStats`: a snapshot of the engine's counters (`LLMEngine.get_stats`), read by a server's metrics."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """A snapshot of the engine's counters (for a server's metrics; plain numbers, no tensors)."""

    num_requests: int  # unfinished requests (an n > 1 request counts once)
    num_running: int  # sequences scheduled in the batch
    num_waiting: int  # sequences queued (waiting for admission, or preempted)
    num_kv_blocks: int
    num_free_kv_blocks: int  # includes freed blocks kept for the prefix cache
    num_prefix_queries: int  # full prompt blocks looked up at admission, total
    num_prefix_hits: int  # of those, found in the prefix cache
    num_preemptions: int  # total
    # speculative decoding (0 without): proposed tokens verified, of those accepted, sequence-steps that verified
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_verified: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        return self.num_spec_accepted_tokens / self.num_spec_proposed_tokens if self.num_spec_proposed_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying sequence-step emits on average: 1 + accepted / verified (0 before any)."""
        return 1.0 + self.num_spec_accepted_tokens / self.num_spec_verified if self.num_spec_verified else 0.0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks
