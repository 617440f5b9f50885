"""Raw Triton kernels: the block-padded row schedule of the fused MoE path, built on the device.

Each routed row n = t*K + k goes to local expert key_n = ids_N[n] - expert_start (rows of dropped
(-1) or non-local experts have no key and are skipped). Every expert's rows are padded up to a
multiple of BLOCK_M, so one GEMM tile never mixes two experts:

    sorted_P[p]  routed row n at padded slot p, or N (the sentinel) for a pad slot
    expert_B[b]  local expert of tile b = rows [b*BLOCK_M, (b+1)*BLOCK_M)
    num_padded   sum_e ceil(count_e / BLOCK_M) * BLOCK_M (one int32)

The order inside one expert is the routed order (deterministic, no atomics). Histograms are the
column sums of a one-hot [SUB, E_PAD]; ranks inside a SUB-row block a pairwise [SUB, SUB] count
(reductions only: scans over 2-D blocks were measured slow). Large N is split into at most 64
CHUNK-row programs: `count` writes a histogram per chunk, `scatter` sums the ones before it.

Legend: N routed rows, E local experts, E_PAD its power-of-two bins, C chunks, P padded slots,
B tiles of BLOCK_M slots.
"""
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter


@triton.jit
def _keys(ids_ptr, offs, N, expert_start, E):
    """Local expert of each row in offs, or -1 (out of range, dropped, non-local)."""
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1).to(tl.int32)
    key = ids - expert_start
    is_local = (ids >= 0) & (key >= 0) & (key < E) & (offs < N)
    return tl.where(is_local, key, -1)


@triton.jit
def _chunk_hist(ids_ptr, start, N, expert_start, E, CHUNK: tl.constexpr, SUB: tl.constexpr,
                E_PAD: tl.constexpr):
    bins = tl.arange(0, E_PAD)
    hist = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        offs = start + s + tl.arange(0, SUB)
        key = _keys(ids_ptr, offs, N, expert_start, E)
        onehot = (key[:, None] == bins[None, :]).to(tl.int32)
        hist += tl.sum(onehot, axis=0)
    return hist


@triton.jit(do_not_specialize=["N"])
def align_count_kernel(ids_ptr, counts_ptr, N, expert_start, E,
                       CHUNK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """counts_CE[c] = histogram of chunk c's local experts."""
    pdl_enter(USE_PDL)
    c = tl.program_id(0)
    hist = _chunk_hist(ids_ptr, c * CHUNK, N, expert_start, E, CHUNK, SUB, E_PAD)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), hist)


@triton.jit(do_not_specialize=["N", "num_chunks", "num_tiles"])
def align_scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ptr, num_padded_ptr,
                         N, expert_start, E, num_chunks, num_tiles,
                         BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                         E_PAD: tl.constexpr, C_PAD: tl.constexpr, TILE_SUB: tl.constexpr, IS_SINGLE: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Writes sorted_P, expert_B and num_padded. IS_SINGLE: one chunk, no counts_CE needed."""
    pdl_enter(USE_PDL)
    c = tl.program_id(0)
    bins = tl.arange(0, E_PAD)
    if IS_SINGLE:
        total = _chunk_hist(ids_ptr, 0, N, expert_start, E, CHUNK, SUB, E_PAD)
        before = tl.zeros([E_PAD], dtype=tl.int32)
    else:  # all chunk histograms in one [C_PAD, E_PAD] load: no serial chain of loads
        chunks = tl.arange(0, C_PAD)
        hist_CE = tl.load(counts_ptr + chunks[:, None] * E_PAD + bins[None, :], mask=(chunks < num_chunks)[:, None], other=0)
        total = tl.sum(hist_CE, axis=0)
        before = tl.sum(tl.where((chunks < c)[:, None], hist_CE, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)  # inclusive: padded slots [end - padded, end) per expert
    start = end - padded

    # Rows of this chunk, in routed order: slot = start[key] + earlier rows of the same expert
    # (rows of earlier sub-blocks via `running`, of this sub-block by a pairwise [SUB, SUB] count).
    running = before + start
    rows = tl.arange(0, SUB)
    for s in range(0, CHUNK, SUB):
        offs = c * CHUNK + s + rows
        key = _keys(ids_ptr, offs, N, expert_start, E)
        onehot = (key[:, None] == bins[None, :]).to(tl.int32)
        same_before = (key[:, None] == key[None, :]) & (rows[None, :] < rows[:, None])
        slot = tl.sum(onehot * running[None, :], axis=1) + tl.sum(same_before.to(tl.int32), axis=1)
        tl.store(sorted_ptr + slot, offs, mask=key >= 0)
        running += tl.sum(onehot, axis=0)

    if c == 0:
        num_padded = tl.sum(padded, axis=0)
        tl.store(num_padded_ptr, num_padded)
        # Pad slots [start + total, end) of every expert hold the sentinel N.
        pad = tl.arange(0, BLOCK_M)
        pad_slot = (start + total)[:, None] + pad[None, :]
        tl.store(sorted_ptr + pad_slot, N, mask=pad_slot < end[:, None])
        # Tile b belongs to the expert whose slots hold b*BLOCK_M: count experts ending at or before it.
        for b0 in range(0, num_tiles, TILE_SUB):
            tiles = b0 + tl.arange(0, TILE_SUB)
            first = tiles * BLOCK_M
            expert = tl.sum((end[None, :] <= first[:, None]).to(tl.int32), axis=1)
            expert = tl.where(first < num_padded, expert, -1)
            tl.store(expert_ptr + tiles, expert, mask=tiles < num_tiles)


@triton.jit
def tile_rows(pid_m, sched_ptr, expert_ptr, num_padded_ptr, num_rows, expert_start, E,
              BLOCK_M: tl.constexpr, INLINE: tl.constexpr, N_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """(num_padded, rows [BLOCK_M], expert) of tile pid_m.

    INLINE (decode, N <= N_PAD rows): sched_ptr holds ids_N and each program derives the same schedule
    as align_scatter_kernel in registers, which saves the schedule launch. Otherwise sched_ptr holds
    sorted_P, written by align_scatter_kernel.
    """
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if INLINE:
        offs = tl.arange(0, N_PAD)
        bins = tl.arange(0, E_PAD)
        key = _keys(sched_ptr, offs, num_rows, expert_start, E)
        padded = (tl.sum((key[:, None] == bins[None, :]).to(tl.int32), axis=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = tl.cumsum(padded, axis=0)
        num_padded = tl.sum(padded, axis=0)
        expert = tl.sum((end <= pid_m * BLOCK_M).to(tl.int32), axis=0)
        start = tl.sum(tl.where(bins == expert, end - padded, 0), axis=0)
        rank = tl.sum(((key[:, None] == key[None, :]) & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
        match = (key[None, :] == expert) & (rank[None, :] == (slots - start)[:, None])  # [BLOCK_M, N_PAD]
        is_match = tl.sum(match.to(tl.int32), axis=1) > 0
        rows = tl.where(is_match, tl.sum(tl.where(match, offs[None, :], 0), axis=1), num_rows)
    else:
        num_padded = tl.load(num_padded_ptr)
        rows = tl.load(sched_ptr + slots, mask=slots < num_padded, other=num_rows)
        expert = tl.load(expert_ptr + pid_m)  # in bounds: expert_B has a slot for every tile
    return num_padded, rows, expert
