"""A step's plan as the model's input tensors, and as the `StepMessage` the driver sends the other ranks.

`flat_inputs(plan)` builds every integer input of the step in one host buffer (token ids, positions,
KV slots, sample rows, query starts, sequence lengths, block tables); `decode_inputs` slices it, once
on the device, into the model's inputs. On one rank that is the whole story. Under a mesh the driver
also encodes what the sampling rank needs on the host (`StepEncoder`): finished ids, per sampling
sequence its id and lengths (and token history with penalties), and, the first time a sequence
samples, its SamplingParams (pickled: rare); `StepDecoder` rebuilds the SampleRequests from that.

Legend: T tokens of the step, B sequences, S sequences that sample, M max blocks per sequence.
"""
from __future__ import annotations

import functools
import pickle
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from moe_infer.engine.sampler import SampledTokens, SampleRequest
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.engine.sequence import SchedulerOutput
from moe_infer.layers.forward_context import AttentionMetadata
from moe_infer.parallel.step_message import (
    FLAG_RESET_STATS, H_FLAGS, H_KIND, H_MAX_BLOCKS, H_MAX_QUERY_LEN, H_MAX_SEQ_LEN, H_NUM_EXTRA,
    H_NUM_HOST, H_NUM_SAMPLE, H_NUM_SEQS, H_NUM_SIDE, H_NUM_TOKENS, H_PATH, H_PAYLOAD_BYTES, HEADER_LEN, KIND_STEP,
    StepMessage,
)


# (T, B, S, M, max_query_len, max_seq_len)
Sizes = Tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class StepInputs:
    input_ids_T: torch.Tensor
    attention: Union[AttentionMetadata, Callable[[], AttentionMetadata]]  # `meta`, or the function that makes it
    sample_rows_S: torch.Tensor
    sizes: Sizes
    bucket: Optional[Tuple[int, int, int]] = None  # laid out in ExtendGraphs' buffer for this bucket's graph
    decode_bucket: Optional[Tuple[int, int]] = None  # laid out in DecodeGraphs' buffers for this (Bp, Mp) graph
    dp: Any = None  # attention data parallelism: a `dp_inputs.DPRows` (this is one replica's segment of the step)

    @functools.cached_property
    def meta(self) -> AttentionMetadata:
        """The step's attention metadata. A step replayed as a graph reads none of it (the graph has its own
        views), so ExtendGraphs passes a function and the views are cut only if an eager run asks."""
        return self.attention if isinstance(self.attention, AttentionMetadata) else self.attention()


class LaunchedStep:
    """A step queued on the device: its plan and its sampled tokens (None when no sequence samples)."""

    def __init__(self, plan: SchedulerOutput, sampled: Optional[SampledTokens]) -> None:
        self.plan, self.sampled = plan, sampled
        self._index: Optional[Dict[int, int]] = None

    def sample_index(self, seq_id: int) -> int:
        """Where seq_id's token is in `sampled.token_ids_B`."""
        if self._index is None:
            self._index = {s.seq_id: i for i, s in enumerate(s for s in self.plan.seqs if s.do_sample)}
        return self._index[seq_id]


def placeholder_rows(plan: SchedulerOutput, prev: Optional[LaunchedStep]) -> Tuple[List[int], List[int]]:
    """(rows of plan's input ids whose token the step in flight samples, that token's index in prev's sample)."""
    rows: List[int] = []
    src: List[int] = []
    at = 0
    for s in plan.seqs:
        if s.input_in_flight:
            if prev is None or prev.sampled is None:
                raise RuntimeError(f"sequence {s.seq_id} takes its input from the step in flight, and none samples")
            rows.append(at)
            src.append(prev.sample_index(s.seq_id))
        at += len(s.token_ids)
    return rows, src


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def _int64(values: List[int]) -> np.ndarray:
    return np.frombuffer(array("q", values), dtype=np.int64)  # array() converts a list faster than np.array()


LONG_SEQ = 32  # a sequence with at least this many tokens in the step gets its ids, positions and slots by numpy


def flat_inputs(plan: SchedulerOutput, block_size: int, extra: Sequence[int] = ()) -> Tuple[np.ndarray, Sizes]:
    """The step's integer inputs in one int64 host buffer, laid out as `decode_inputs` reads them:
    ids | positions | slots | sample rows (int64 on the device) | query starts | seq lens | block tables
    (int32 on the device, each padded to a multiple of 4 entries), then `extra` (the caller's own, not read
    by decode_inputs).

    Host time matters here (it delays the first kernel of every step, and the time to first token):
    the ids, positions and KV slots of a long sequence (a prompt chunk) are built by numpy; those of
    short ones (decodes) go through Python lists, one conversion for a run of them."""
    seqs, bs = plan.seqs, block_size
    max_blocks = max(len(s.block_table) for s in seqs)
    parts: List[Tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids, positions, slots) per run
    ids: List[int] = []
    positions: List[int] = []
    slots: List[int] = []
    tables: List[int] = []
    query_start, seq_lens, sample_rows = [0], [], []
    max_query_len = 0
    for s in seqs:
        start, table, n = s.start_pos, s.block_table, len(s.token_ids)
        if n >= LONG_SEQ:
            if ids:  # the run of short sequences before this one
                parts.append((_int64(ids), _int64(positions), _int64(slots)))
                ids, positions, slots = [], [], []
            pos_n = np.arange(start, start + n, dtype=np.int64)
            table_n = np.array(table, dtype=np.int64)
            parts.append((np.asarray(s.token_ids, dtype=np.int64), pos_n, table_n[pos_n // bs] * bs + pos_n % bs))
        else:
            ids += s.token_ids if isinstance(s.token_ids, list) else s.token_ids.tolist()
            positions += range(start, start + n)
            pos, end = start, start + n
            while pos < end:  # the KV slots, one block at a time
                i = pos // bs
                stop, base = min(end, (i + 1) * bs), (table[i] - i) * bs
                slots += range(base + pos, base + stop)
                pos = stop
        tables += table
        tables += [-1] * (max_blocks - len(table))
        query_start.append(query_start[-1] + n)
        seq_lens.append(start + n)
        max_query_len = max(max_query_len, n)
        if s.do_sample:
            if s.spec_token_ids:  # speculative decoding: every proposed token and the one before it are verified
                sample_rows += range(query_start[-1] - 1 - len(s.spec_token_ids), query_start[-1])
            else:
                sample_rows.append(query_start[-1] - 1)
    B = len(seqs)  # the int32 segments start 16 bytes apart (Triton specializes kernels on pointer alignment)
    rest = (sample_rows + query_start + [0] * (_pad4(B + 1) - B - 1) + seq_lens + [0] * (_pad4(B) - B) + tables
            + list(extra))
    if not parts:  # only short sequences: one conversion
        host = _int64(ids + positions + slots + rest)
    else:
        if ids:
            parts.append((_int64(ids), _int64(positions), _int64(slots)))
        host = np.concatenate([p[0] for p in parts] + [p[1] for p in parts] + [p[2] for p in parts]
                              + [_int64(rest)])
    T = query_start[-1]
    return host, (T, len(seqs), len(sample_rows), max_blocks, max_query_len, max(seq_lens))


@dataclass(frozen=True)
class HostSegments:
    """`flat_inputs`' buffer cut into its segments (numpy views, int64)."""

    ids_T: np.ndarray
    positions_T: np.ndarray
    slots_T: np.ndarray
    sample_rows_S: np.ndarray
    query_start_B1: np.ndarray
    seq_lens_B: np.ndarray
    block_tables_BM: np.ndarray
    extra: np.ndarray


def host_segments(flat: np.ndarray, sizes: Sizes) -> HostSegments:
    """The segments of a `flat_inputs` buffer on the host (for a layout of its own: graph_inputs.py)."""
    T, B, S, M = sizes[:4]
    q = 3 * T + S  # where the query starts begin; each int32 segment is padded to 4 entries
    s = q + _pad4(B + 1)
    t = s + _pad4(B)
    return HostSegments(flat[:T], flat[T:2 * T], flat[2 * T:3 * T], flat[3 * T:q], flat[q:q + B + 1], flat[s:s + B],
                        flat[t:t + B * M].reshape(B, M), flat[t + B * M:])


def decode_inputs(flat: torch.Tensor, sizes: Sizes, block_size: int) -> StepInputs:
    """The model inputs from the step's flat int64 buffer (already on the compute device): one cast
    makes the int32 tail (query starts, seq lens, block tables; each 16-byte aligned, padded between)."""
    T, B, S, M, max_query_len, max_seq_len = sizes
    pad_q, pad_s = _pad4(B + 1), _pad4(B)
    input_ids_T, positions_T, slot_mapping_T, sample_rows_S, tail = flat.split([T, T, T, S, pad_q + pad_s + B * M])
    query_start_loc_B1, _, seq_lens_B, _, block_tables_BM = tail.to(torch.int32).split(
        [B + 1, pad_q - B - 1, B, pad_s - B, B * M])
    meta = AttentionMetadata(
        positions_T=positions_T, slot_mapping_T=slot_mapping_T, block_tables_BM=block_tables_BM.view(B, M),
        query_start_loc_B1=query_start_loc_B1, seq_lens_B=seq_lens_B,
        max_query_len=max_query_len, max_seq_len=max_seq_len, block_size=block_size,
    )
    return StepInputs(input_ids_T, meta, sample_rows_S, sizes)


def message_sizes(msg: StepMessage) -> Sizes:
    return message_layout(msg)[0]


def message_layout(msg: StepMessage) -> Tuple[Sizes, int, int, int]:
    """(sizes, path, extra entries, payload bytes) of a received step message."""
    h = msg.header.tolist()
    sizes = (h[H_NUM_TOKENS], h[H_NUM_SEQS], h[H_NUM_SAMPLE], h[H_MAX_BLOCKS], h[H_MAX_QUERY_LEN], h[H_MAX_SEQ_LEN])
    return sizes, h[H_PATH], h[H_NUM_EXTRA], h[H_PAYLOAD_BYTES]


def plan_requests(plan: SchedulerOutput) -> List[SampleRequest]:
    """The SampleRequests of a plan's sampling sequences (on the driver, which holds the plan)."""
    return [SampleRequest(s.seq_id, s.params, s.num_prompt_tokens, s.start_pos + len(s.token_ids) - s.num_prompt_tokens,
                          s.history, s.input_in_flight and s.history is not None) for s in plan.seqs if s.do_sample]


def per_plan_entry(plan: SchedulerOutput, tokens_S: List[int], logprobs_S: List[Optional[tuple]]
                   ) -> Tuple[List[Optional[int]], List[Optional[tuple]]]:
    """The sampled tokens of a plan's sampling sequences spread over all its entries (None: no sample)."""
    tokens: List[Optional[int]] = [None] * len(plan.seqs)
    logprobs: List[Optional[tuple]] = [None] * len(plan.seqs)
    it = iter(zip(tokens_S, logprobs_S))
    for i, s in enumerate(plan.seqs):
        if s.do_sample:
            tokens[i], logprobs[i] = next(it)
    return tokens, logprobs


class StepEncoder:
    """Driver side: SchedulerOutput -> StepMessage (header, and the sampler's host part when the sampler is another
    rank). Remembers which sequences' params that rank holds and the finished ids not sent yet (steps with an empty
    plan send nothing)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.known: Set[int] = set()
        self.finished: List[int] = []
        self.reset_stats = False

    def note_finished(self, seq_ids: List[int]) -> None:
        self.finished += seq_ids

    def encode(self, plan: SchedulerOutput, sizes: Sizes, path: int, num_extra: int, num_bytes: int,
               for_sampler: bool = True) -> StepMessage:
        """The message of a step laid out with `flat_inputs` (sizes; num_extra entries of the caller's own at its
        end) on `path` into num_bytes device bytes (the payload the other ranks receive). for_sampler: the sampler
        is another rank (the host part is built)."""
        header = [0] * HEADER_LEN
        header[H_KIND] = KIND_STEP
        for index, value in zip((H_NUM_TOKENS, H_NUM_SEQS, H_NUM_SAMPLE, H_MAX_BLOCKS, H_MAX_QUERY_LEN, H_MAX_SEQ_LEN),
                                sizes):
            header[index] = value
        header[H_PAYLOAD_BYTES], header[H_PATH], header[H_NUM_EXTRA] = num_bytes, path, num_extra
        header[H_FLAGS] = FLAG_RESET_STATS if self.reset_stats else 0
        self.reset_stats = False
        host, side = self._sampler_part(plan) if for_sampler else ([], b"")
        header[H_NUM_HOST], header[H_NUM_SIDE] = len(host), len(side)
        return StepMessage(
            torch.tensor(header, dtype=torch.int64), torch.tensor(host, dtype=torch.int64),
            torch.frombuffer(bytearray(side), dtype=torch.uint8) if side else torch.empty(0, dtype=torch.uint8),
        )

    def _sampler_part(self, plan: SchedulerOutput) -> Tuple[List[int], bytes]:
        """(host ints, pickled new SamplingParams) for a sampler on another rank."""
        self.note_finished(plan.finished_seq_ids)
        host = [len(self.finished)] + self.finished + [0]  # then the number of sampling sequences (below)
        at_count = len(host) - 1
        self.known.difference_update(self.finished)
        self.finished = []
        new_params: Dict[int, SamplingParams] = {}
        histories: List[int] = []
        for s in plan.seqs:
            if not s.do_sample:
                continue
            hist = s.history or []
            host += (s.seq_id, s.num_prompt_tokens, s.start_pos + len(s.token_ids) - s.num_prompt_tokens, len(hist))
            histories += hist
            if s.seq_id not in self.known:
                new_params[s.seq_id] = s.params
                self.known.add(s.seq_id)
        host[at_count] = sum(1 for s in plan.seqs if s.do_sample)
        host += histories
        if plan.parts is not None:  # attention data parallelism: each replica's sampling sequences, in order
            host += [sum(1 for s in part.seqs if s.do_sample) for part in plan.parts]
        return host, pickle.dumps(new_params) if new_params else b""


class StepDecoder:
    """Receiving side: the finished ids and SampleRequests of a StepMessage (keeps the params it was sent)."""

    def __init__(self) -> None:
        self.params: Dict[int, SamplingParams] = {}
        self.replica_samples: List[int] = []  # attention data parallelism: the last message's per-replica counts

    def decode(self, msg: StepMessage) -> Tuple[List[int], Optional[List[SampleRequest]]]:
        host = msg.host.tolist()
        num_finished = host[0]
        finished = host[1:1 + num_finished]
        for seq_id in finished:
            self.params.pop(seq_id, None)
        if msg.side.numel():
            self.params.update(pickle.loads(msg.side.numpy().tobytes()))
        S = host[1 + num_finished]  # the sampling sequences (under attention data parallelism fewer than the
        # header's S, each replica's sampling rows being padded alike)
        rows = host[2 + num_finished:2 + num_finished + 4 * S]
        hist_at = 2 + num_finished + 4 * S
        reqs = []
        for i in range(S):
            seq_id, num_prompt, num_output, num_hist = rows[4 * i:4 * i + 4]
            history = host[hist_at:hist_at + num_hist] if num_hist else None
            hist_at += num_hist
            reqs.append(SampleRequest(seq_id, self.params[seq_id], num_prompt, num_output, history))
        self.replica_samples = host[hist_at:]
        return finished, reqs
