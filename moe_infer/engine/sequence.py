"""A request's sequence: its tokens, how many of them have KV in the cache, and its blocks.

Plain Python, no tensors (a numpy copy of the prompt at most). `token_ids` holds the prompt then every
generated token; the last generated token has no KV yet (it is the next step's input), so
`num_computed_tokens` trails `len(token_ids)` by one while decoding, and by the unprocessed prompt while
prefilling.

Batches in flight (scheduled, not postprocessed yet: pipeline stages, async scheduling) hold
`num_pending_tokens` of the sequence (their KV is being computed) and may sample `num_placeholders`
tokens the host does not know yet; async scheduling schedules the next step on top of them
(`num_scheduled_tokens`, and a placeholder as the input of the next step, taken on the device).
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence as Sequence_, Union

import numpy as np

from moe_infer.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0


_counter = itertools.count()
PLACEHOLDER_TOKEN = -1  # a token sampled by a step in flight, not known on the host yet


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: List[int], params: SamplingParams,
                 prompt: Optional[str] = None, prompt_array: Optional[np.ndarray] = None) -> None:
        self.seq_id = next(_counter)
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids: List[int] = list(prompt_token_ids)
        # the prompt as int64 [num_prompt_tokens] when the request came with one (ids checked by numpy): a prompt
        # chunk's ids go to the step's buffer from it, not through a Python list (never written; shared by n samples)
        self.prompt_array = prompt_array
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, taken from the prefix cache at the last admission
        self.block_table: List[int] = []
        self.block_hashes: List[int] = []  # hashes of the leading full, computed blocks
        self.status = SequenceStatus.WAITING
        self.num_in_flight = 0  # batches that scheduled it and have not been postprocessed yet
        self.num_pending_tokens = 0  # its tokens in those batches (KV being computed)
        self.num_placeholders = 0  # tokens those batches sample, not in token_ids yet (0 or 1)
        self.finish_reason: Optional[str] = None  # stop | length | abort | error
        self.stop_reason: Optional[object] = None  # the stop string or stop token id that matched
        self.error: Optional[str] = None
        self.metrics = SequenceMetrics(arrival_time=time.monotonic())
        # n > 1: the request's first sample; this one is admitted once the leader's prompt is computed
        # and takes the prompt's KV from the prefix cache (moe_infer/engine/request_state.py)
        self.leader: Optional["Sequence"] = None
        # speculative decoding (moe_infer/engine/speculative/): the tokens proposed for the next step (verified by
        # it), the draft model's probabilities of them ([k, V] on the device; None: proposed deterministically),
        # tokens whose KV the draft model holds, and the tokens the last step appended (1 without speculation)
        self.spec_token_ids: List[int] = []
        self.spec_probs = None
        self.num_draft_computed = 0
        self.num_new_tokens = 1

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> List[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def in_flight(self) -> bool:
        return self.num_in_flight > 0

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens whose KV is computed or is being computed by a batch in flight."""
        return self.num_computed_tokens + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens (known or placeholder) that no step has scheduled yet."""
        return len(self.token_ids) + self.num_placeholders - self.num_scheduled_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: object = None, error: Optional[str] = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
        self.metrics.finished_time = time.monotonic()

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: feed `token_ids` at positions start_pos.. and maybe sample."""

    seq_id: int
    token_ids: Union[List[int], np.ndarray]  # a chunk of a prompt with a prompt_array: a view of it (int64)
    start_pos: int
    block_table: List[int]
    do_sample: bool
    params: Optional[SamplingParams] = None  # set when do_sample
    history: Optional[List[int]] = None  # prompt + output tokens known on the host, when do_sample with penalties
    num_prompt_tokens: int = 0
    # async scheduling: the one input token is the token this sequence samples in the step in flight; the
    # runner takes it from that step's sampled ids on the device (token_ids holds PLACEHOLDER_TOKEN)
    input_in_flight: bool = False
    # speculative decoding: the last len(spec_token_ids) of token_ids are proposed tokens this step verifies (it
    # samples at each of them and at the token before: len + 1 rows); spec_probs: their draft probabilities [k, V]
    # on the device, None when proposed deterministically (n-gram, greedy draft). Never set under a mesh.
    spec_token_ids: Sequence_[int] = ()
    spec_probs: object = None


@dataclass
class SchedulerOutput:
    """A step's plan: plain, picklable data (expert parallelism broadcasts it from rank 0)."""

    seqs: List[ScheduledSeq] = field(default_factory=list)
    finished_seq_ids: List[int] = field(default_factory=list)  # since the last plan: drop their state
    num_preempted: int = 0
    # attention data parallelism: each replica's own plan (seqs is their concatenation, replica-major)
    parts: Optional[List["SchedulerOutput"]] = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
