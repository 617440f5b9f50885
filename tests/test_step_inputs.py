"""The step's host buffer (`flat_inputs`) and the model inputs sliced from it (`decode_inputs`) against a
naive per-token loop over the plan: long sequences take the numpy path, short ones the list path, in any
order and mix."""
import random

import numpy as np
import pytest
import torch

from moe_infer.engine.sequence import ScheduledSeq, SchedulerOutput
from moe_infer.engine.step_inputs import LONG_SEQ, decode_inputs, flat_inputs

pytestmark = pytest.mark.timeout(60)


def _plan(lengths, block_size, rng):
    """Sequences with `lengths` tokens this step after a random cached context, scattered block tables."""
    plan = SchedulerOutput()
    free = rng.sample(range(10_000), 10_000)
    for i, n in enumerate(lengths):
        start = rng.choice([0, rng.randrange(0, 50)])
        table = [free.pop() for _ in range(-(-(start + n) // block_size) + rng.randrange(0, 2))]
        plan.seqs.append(ScheduledSeq(
            seq_id=i, token_ids=[rng.randrange(0, 151_936) for _ in range(n)], start_pos=start,
            block_table=table, do_sample=rng.random() < 0.7, params=None, history=None, num_prompt_tokens=n,
            input_in_flight=False))
    return plan


def _naive(plan, block_size):
    """Per token: id, position, slot = table[pos // bs] * bs + pos % bs; per sequence: the rest."""
    ids, pos, slots, qsl, lens, rows = [], [], [], [0], [], []
    M = max(len(s.block_table) for s in plan.seqs)
    tables = []
    for s in plan.seqs:
        for j, t in enumerate(s.token_ids):
            p = s.start_pos + j
            ids.append(t), pos.append(p), slots.append(s.block_table[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + len(s.token_ids))
        lens.append(s.start_pos + len(s.token_ids))
        if s.do_sample:
            rows.append(qsl[-1] - 1)
        tables.append(s.block_table + [-1] * (M - len(s.block_table)))
    return ids, pos, slots, qsl, lens, rows, tables


@pytest.mark.parametrize("lengths", [
    [1] * 9,  # decodes only: the list path
    [700],  # one prompt: the numpy path
    [1, 1, 300, 1, LONG_SEQ, LONG_SEQ - 1, 5, 1],  # runs of short sequences around long ones
    [LONG_SEQ, 1, 1],
    [3, 200, 64, 1],
])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("as_array", [False, True])  # True: prompt chunks as views of an int64 prompt array
def test_flat_inputs_match_a_per_token_loop(lengths, block_size, as_array):
    rng = random.Random(sum(lengths) * block_size)
    plan = _plan(lengths, block_size, rng)
    if as_array:
        for s in plan.seqs:
            s.token_ids = np.array(s.token_ids, dtype=np.int64)
    flat, sizes = flat_inputs(plan, block_size, extra=[7, 8])
    ids, pos, slots, qsl, lens, rows, tables = _naive(plan, block_size)
    T, B = len(ids), len(plan.seqs)
    assert sizes == (T, B, len(rows), len(tables[0]), max(lengths), max(lens))
    assert flat.dtype.name == "int64" and flat[-2:].tolist() == [7, 8]
    inputs = decode_inputs(torch.from_numpy(flat[:-2]), sizes, block_size)
    assert inputs.input_ids_T.tolist() == ids
    assert inputs.meta.positions_T.tolist() == pos
    assert inputs.meta.slot_mapping_T.tolist() == slots
    assert inputs.sample_rows_S.tolist() == rows
    assert inputs.meta.query_start_loc_B1.tolist() == qsl and inputs.meta.query_start_loc_B1.dtype == torch.int32
    assert inputs.meta.seq_lens_B.tolist() == lens and inputs.meta.seq_lens_B.dtype == torch.int32
    assert inputs.meta.block_tables_BM.tolist() == tables and inputs.meta.block_tables_BM.dtype == torch.int32
    assert (inputs.meta.max_query_len, inputs.meta.max_seq_len) == (max(lengths), max(lens))
    # Triton specializes on 16-byte pointer alignment: the int32 tensors the kernels read must not vary with B
    meta = inputs.meta
    assert all(t.data_ptr() % 16 == 0 for t in (meta.query_start_loc_B1, meta.seq_lens_B, meta.block_tables_BM))
