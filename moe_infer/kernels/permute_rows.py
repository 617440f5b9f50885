"""Raw Triton kernels: rank routed rows within their expert, and sort / pad them by expert.

Legend: N routed rows, V visiting positions (v -> row n = order[v], or n = v), E experts (keys),
S tiles of BLOCK_N visiting positions, P padded slots, B blocks of BLOCK_SIZE slots.
Three launches, no host sync: (1) tile histograms [S, BLOCK_E]; (2) an exclusive scan of them over
the tiles, per expert, giving each tile's base rank and the expert totals; (3) per tile: rank =
base + rank inside the tile; then the sorted order, the inverse map and the padded layout.
A row's key is its local expert (id - expert_start in [0, E)) or -1 (dropped / not local).
Wrappers: `moe_infer.routing.triton_permute`.
"""
import triton
import triton.language as tl


@triton.jit
def _visit_keys(ids_ptr, order_ptr, v_B, N, E, expert_start, HAS_ORDER: tl.constexpr):
    is_row_B = v_B < N
    if HAS_ORDER:
        n_B = tl.load(order_ptr + v_B, mask=is_row_B, other=0).to(tl.int32)
    else:
        n_B = v_B
    id_B = tl.load(ids_ptr + n_B, mask=is_row_B, other=-1).to(tl.int32)
    local_B = id_B - expert_start
    is_local_B = is_row_B & (id_B >= 0) & (local_B >= 0) & (local_B < E)
    return n_B, tl.where(is_local_B, local_B, -1), is_row_B


@triton.jit
def tile_hist_kernel(
    ids_ptr, order_ptr, tile_counts_ptr, N, E, expert_start,
    HAS_ORDER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    v_B = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    _, key_B, _ = _visit_keys(ids_ptr, order_ptr, v_B, N, E, expert_start, HAS_ORDER)
    cols_E = tl.arange(0, BLOCK_E)
    counts_E = tl.sum(tl.where(key_B[:, None] == cols_E[None, :], 1, 0), axis=0)
    tl.store(tile_counts_ptr + pid * BLOCK_E + cols_E, counts_E)


@triton.jit
def tile_scan_kernel(
    tile_counts_ptr, counts_ptr, num_tiles, E, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_E: tl.constexpr,
):
    """In place: tile_counts[s, e] <- rows of expert e in tiles < s. counts[e] <- all rows of e."""
    cols_C = tl.program_id(0) * CHUNK_E + tl.arange(0, CHUNK_E)
    carry_C = tl.zeros((CHUNK_E,), tl.int32)
    for s0 in range(0, num_tiles, BLOCK_S):
        s_S = s0 + tl.arange(0, BLOCK_S)
        ptrs_SC = tile_counts_ptr + s_S[:, None] * BLOCK_E + cols_C[None, :]
        mask_SC = s_S[:, None] < num_tiles
        c_SC = tl.load(ptrs_SC, mask=mask_SC, other=0)
        incl_SC = tl.cumsum(c_SC, axis=0)
        tl.store(ptrs_SC, incl_SC - c_SC + carry_C[None, :], mask=mask_SC)
        carry_C += tl.sum(c_SC, axis=0)
    tl.store(counts_ptr + cols_C, carry_C.to(tl.int64), mask=cols_C < E)


@triton.jit
def _select(key_B, cols_E, val_E):
    """val_E[key_B] for keys in [0, BLOCK_E) (0 for key -1), without a memory gather."""
    return tl.sum(tl.where(key_B[:, None] == cols_E[None, :], val_E[None, :], 0), axis=1)


@triton.jit
def tile_scatter_kernel(
    ids_ptr, order_ptr, weights_ptr, tile_counts_ptr, counts_ptr,
    rank_ptr, order_out_ptr, inv_ptr, token_ptr, w_out_ptr, offsets_ptr,
    sorted_rows_ptr, block_expert_ptr, padded_offsets_ptr, num_padded_ptr,
    N, E, expert_start, K, num_tiles, num_slots, num_blocks,
    HAS_ORDER: tl.constexpr, WRITE_RANK: tl.constexpr, WRITE_PERMUTE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr,
):
    pid = tl.program_id(0)
    cols_E = tl.arange(0, BLOCK_E)
    is_e_E = cols_E < E
    counts_E = tl.load(counts_ptr + cols_E, mask=is_e_E, other=0).to(tl.int32)
    offsets_E = tl.cumsum(counts_E, axis=0) - counts_E
    num_local = tl.sum(counts_E, axis=0)
    if pid < num_tiles:
        v_B = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_B, key_B, is_row_B = _visit_keys(ids_ptr, order_ptr, v_B, N, E, expert_start, HAS_ORDER)
        is_local_B = key_B >= 0
        base_E = tl.load(tile_counts_ptr + pid * BLOCK_E + cols_E)
        i_B = tl.arange(0, BLOCK_N)
        before_BB = (key_B[:, None] == key_B[None, :]) & (i_B[None, :] < i_B[:, None])
        within_B = tl.sum(tl.where(before_BB, 1, 0), axis=1)  # same key earlier in this tile
        rank_B = _select(key_B, cols_E, base_E) + within_B
        if WRITE_RANK:
            tl.store(rank_ptr + n_B, tl.where(is_local_B, rank_B, -1).to(tl.int64), mask=is_row_B)
        if WRITE_PERMUTE:
            local_before_tile = tl.sum(base_E, axis=0)  # local rows in earlier tiles
            other_rank_B = pid * BLOCK_N - local_before_tile + within_B
            dest_B = tl.where(is_local_B, _select(key_B, cols_E, offsets_E) + rank_B, num_local + other_rank_B)
            w_B = tl.load(weights_ptr + n_B, mask=is_row_B, other=0.0).to(tl.float32)
            tl.store(order_out_ptr + dest_B, n_B.to(tl.int64), mask=is_row_B)
            tl.store(inv_ptr + n_B, dest_B.to(tl.int64), mask=is_row_B)
            tl.store(token_ptr + dest_B, (n_B // K).to(tl.int64), mask=is_row_B)
            tl.store(w_out_ptr + dest_B, tl.where(is_local_B, w_B, 0.0), mask=is_row_B)
            if BLOCK_SIZE > 0:
                padded_E = (counts_E + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
                poffs_E = tl.cumsum(padded_E, axis=0) - padded_E
                slot_B = _select(key_B, cols_E, poffs_E) + rank_B
                tl.store(sorted_rows_ptr + slot_B, n_B, mask=is_row_B & is_local_B)
    if WRITE_PERMUTE:
        if pid == 0:
            tl.store(offsets_ptr + cols_E, offsets_E.to(tl.int64), mask=is_e_E)
            tl.store(offsets_ptr + E, num_local.to(tl.int64))
        if BLOCK_SIZE > 0:
            padded_E = (counts_E + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
            pend_E = tl.where(is_e_E, tl.cumsum(padded_E, axis=0), 2147483647)
            poffs_E = tl.cumsum(padded_E, axis=0) - padded_E
            if pid == 0:
                tl.store(padded_offsets_ptr + cols_E, poffs_E.to(tl.int64), mask=is_e_E)
                tl.store(padded_offsets_ptr + E, tl.sum(padded_E, axis=0).to(tl.int64))
                tl.store(num_padded_ptr, tl.sum(padded_E, axis=0))
            # padding slots of this program's chunk get the sentinel N (real slots are written above)
            p_P = pid * BLOCK_P + tl.arange(0, BLOCK_P)
            e_P = tl.sum(tl.where(pend_E[None, :] <= p_P[:, None], 1, 0), axis=1)  # expert owning slot p
            used_P = (e_P < E) & (p_P - _select(e_P, cols_E, poffs_E) < _select(e_P, cols_E, counts_E))
            tl.store(sorted_rows_ptr + p_P, tl.full((BLOCK_P,), N, tl.int32), mask=(p_P < num_slots) & ~used_P)
            b_B = pid * BLOCK_B + tl.arange(0, BLOCK_B)
            e_B = tl.sum(tl.where(pend_E[None, :] <= (b_B * BLOCK_SIZE)[:, None], 1, 0), axis=1)
            tl.store(block_expert_ptr + b_B, tl.where(e_B < E, e_B, -1), mask=b_B < num_blocks)
