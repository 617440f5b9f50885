"""A step's plan as it travels between the ranks: a fixed-size header on the host, the inputs on the device.

    header   int64 [HEADER_LEN], host   the step's sizes, its path (which buffers and graphs it runs), flags
    host     int64 [num_host], host     what a sampler on another rank needs on the host: finished sequence ids,
                                        the number of sampling sequences and, per sampling sequence, its id,
                                        prompt / output lengths and the token history when it has penalties; under
                                        attention data parallelism then each replica's number of sampling
                                        sequences (empty when the driver samples: pp = 1)
    side     uint8 [num_side], host     a pickle of the SamplingParams of sequences that sampler has not seen
                                        yet: only in steps that start sampling a new request (and pp > 1)

Beside it, not in the message: the payload: uint8 [H_PAYLOAD_BYTES] on the device, the step's inputs exactly
as the driver laid them out in the device buffer of the step's path (token ids, positions, KV slots, query starts,
sequence lengths, sample rows, block tables, padding included: see moe_infer/engine/step_paths.py); received into
the same buffer, so the receiving rank's graphs read it where the driver's do.

The header (with the host ints when they fit) is the one host message of a step; the payload goes over the
device group (NCCL on GPU), into the receiver's static buffer, with no host sync. The runner builds and reads
them (`moe_infer.engine.step_inputs`, `step_paths`); the mesh only moves them (`channel.py`). An END header
(kind KIND_END) closes a `generate` on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

KIND_STEP, KIND_END = 1, 2
# header fields, in order
(H_KIND, H_NUM_TOKENS, H_NUM_SEQS, H_NUM_SAMPLE, H_MAX_BLOCKS, H_MAX_QUERY_LEN, H_MAX_SEQ_LEN, H_NUM_HOST,
 H_NUM_SIDE, H_PAYLOAD_BYTES, H_FLAGS, H_PATH, H_NUM_EXTRA) = range(13)
HEADER_LEN = 13
FLAG_RESET_STATS = 1  # reset the expert-load statistics before this step
# the step's path: where its inputs lie and what runs it (moe_infer/engine/step_paths.py)
PATH_EAGER, PATH_DECODE_GRAPH, PATH_EXTEND_GRAPH = 0, 1, 2


@dataclass
class StepMessage:
    header: torch.Tensor  # int64 [HEADER_LEN], CPU
    host: torch.Tensor  # int64 [num_host], CPU
    side: torch.Tensor  # uint8 [num_side], CPU

    def field(self, index: int) -> int:
        return int(self.header[index])

    @property
    def kind(self) -> int:
        return self.field(H_KIND)

    @property
    def flags(self) -> int:
        return self.field(H_FLAGS)


def end_message() -> StepMessage:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[H_KIND] = KIND_END
    return StepMessage(header, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.uint8))


# ---- sampled tokens as one float64 tensor (ids are exact in float64) -------------------------------
def result_size(counts: List[Optional[int]]) -> int:
    """counts: logprobs requested per sampling sequence (None: none)."""
    return sum(1 if n is None else 3 + 2 * n for n in counts)


def pack_result(tokens: List[int], logprobs: List[Optional[tuple]], counts: List[Optional[int]]) -> torch.Tensor:
    values: List[float] = []
    for token, lp, n in zip(tokens, logprobs, counts):
        values.append(token)
        if n is not None:
            chosen, rank, top_ids, top_vals = lp
            values += [chosen, rank, *top_ids, *top_vals]
    return torch.tensor(values, dtype=torch.float64)


def unpack_result(buf: torch.Tensor, counts: List[Optional[int]]) -> Tuple[List[int], List[Optional[tuple]]]:
    values, at = buf.tolist(), 0
    tokens: List[int] = []
    logprobs: List[Optional[tuple]] = []
    for n in counts:
        tokens.append(int(values[at]))
        if n is None:
            logprobs.append(None)
            at += 1
            continue
        chosen, rank = values[at + 1], int(values[at + 2])
        top_ids = [int(v) for v in values[at + 3:at + 3 + n]]
        logprobs.append((chosen, rank, top_ids, values[at + 3 + n:at + 3 + 2 * n]))
        at += 3 + 2 * n
    return tokens, logprobs


def counts_of(reqs) -> List[Optional[int]]:
    return [r.params.logprobs for r in reqs]
