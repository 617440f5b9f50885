"""A step's plan as tensors: what the driver sends every other rank each step (no pickle per step).

    header  int64 [HEADER_LEN], host   the sizes below (fixed length: received first)
    host    int64 [num_host], host     what the sampler needs on the host: finished sequence ids and,
                                       per sampling sequence, its id, prompt / output lengths and the
                                       token history when it has penalties
    side    uint8 [num_side], host     a pickle of the SamplingParams of sequences the ranks have not
                                       seen yet: only in steps that start sampling a new request
    flat    int64 [num_flat], device   the step's tensors, one buffer: token ids, positions, KV slots,
                                       query starts, sequence lengths, sample rows, block tables

The runner builds and reads them (`moe_infer.engine.step_inputs`); the mesh only moves them
(`channel.py`): header, host and side over the CPU (gloo) control group, flat over the device
group, so the host needs no device sync to learn the sizes. An END header (kind KIND_END) closes a
`generate` on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KIND_STEP, KIND_END = 1, 2
# header fields, in order
H_KIND, H_NUM_TOKENS, H_NUM_SEQS, H_NUM_SAMPLE, H_MAX_BLOCKS, H_MAX_QUERY_LEN, H_MAX_SEQ_LEN, \
    H_NUM_HOST, H_NUM_SIDE, H_NUM_FLAT, H_FLAGS = range(11)
HEADER_LEN = 11
FLAG_RESET_STATS = 1  # reset the expert-load statistics before this step


@dataclass
class StepMessage:
    header: torch.Tensor  # int64 [HEADER_LEN], CPU
    host: torch.Tensor  # int64 [num_host], CPU
    side: torch.Tensor  # uint8 [num_side], CPU
    flat: torch.Tensor  # int64 [num_flat], on the compute device once received

    def field(self, index: int) -> int:
        return int(self.header[index])

    @property
    def kind(self) -> int:
        return self.field(H_KIND)

    @property
    def num_tokens(self) -> int:
        return self.field(H_NUM_TOKENS)


def end_message() -> StepMessage:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[H_KIND] = KIND_END
    empty = torch.empty(0, dtype=torch.int64)
    return StepMessage(header, empty, torch.empty(0, dtype=torch.uint8), empty)
