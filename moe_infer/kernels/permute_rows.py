"""Raw Triton kernels: rank routed rows within their expert, and sort / pad them by expert.

Legend: N routed rows, V visiting positions (v -> row n = order[v], or n = v), E experts (keys),
S tiles of BLOCK_N visiting positions, P padded slots, B blocks of BLOCK_SIZE slots.
Three launches, no host sync: (1) tile histograms [S, BLOCK_E] (and the padding sentinel fill);
(2) an exclusive scan of them over the tiles, per expert, giving each tile's base rank and the
expert totals; (3) per tile: rank = base + rank inside the tile (a [BLOCK_N, BLOCK_N] compare, or
`within` from the fused gate; no E-wide one-hot work per row); then the sorted order, the inverse map, the padded layout, the block map.
A row's key is its local expert (id - expert_start in [0, E)) or -1 (dropped / not local).
Wrappers: `moe_infer.routing.triton_permute`.
"""
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter


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


@triton.jit(do_not_specialize=["N", "num_tiles", "num_slots"])
def tile_hist_kernel(
    ids_ptr, order_ptr, tile_counts_ptr, sorted_rows_ptr, N, E, expert_start, num_tiles, num_slots,
    HAS_ORDER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, FILL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """tile_counts[s, e] <- rows of key e in tile s; also pre-fills the padded slots with the sentinel N
    (launch 3 overwrites the slots that hold rows)."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    if pid < num_tiles:
        v_B = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        _, key_B, _ = _visit_keys(ids_ptr, order_ptr, v_B, N, E, expert_start, HAS_ORDER)
        cols_E = tl.arange(0, BLOCK_E)
        counts_E = tl.sum(tl.where(key_B[:, None] == cols_E[None, :], 1, 0), axis=0)
        tl.store(tile_counts_ptr + pid * BLOCK_E + cols_E, counts_E)
    p_F = pid * FILL + tl.arange(0, FILL)
    tl.store(sorted_rows_ptr + p_F, tl.full((FILL,), N, tl.int32), mask=p_F < num_slots)


@triton.jit(do_not_specialize=["num_tiles"])
def tile_scan_kernel(
    tile_counts_ptr, counts_ptr, num_tiles, E, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_E: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """In place: tile_counts[s, e] <- rows of expert e in tiles < s. counts[e] <- all rows of e."""
    pdl_enter(USE_PDL)
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


@triton.jit(do_not_specialize=["N", "num_tiles", "num_blocks", "num_groups"])
def tile_scatter_kernel(
    ids_ptr, order_ptr, weights_ptr, tile_counts_ptr, counts_ptr, within_ptr, hist_ptr,
    rank_ptr, order_out_ptr, inv_ptr, token_ptr, w_out_ptr, offsets_ptr,
    sorted_rows_ptr, block_expert_ptr, padded_offsets_ptr, num_padded_ptr,
    N, E, expert_start, K, num_tiles, num_blocks, num_groups,
    HAS_ORDER: tl.constexpr, WRITE_RANK: tl.constexpr, WRITE_PERMUTE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, HAS_WITHIN: tl.constexpr,
    TILE_N: tl.constexpr, GROUP_TILES: tl.constexpr, ZERO_GROUPS: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    """HAS_WITHIN: the rows come from the fused gate (`routing_gate_kernel` with TILE_COUNTS): every row is
    local, within[t, e] (int8 [T, BLOCK_E]) already holds row n = t*K + k's rank inside its tile of TILE_N rows, and one program places the
    BLOCK_N rows of BLOCK_N / TILE_N tiles (num_tiles then counts programs). Otherwise TILE_N == BLOCK_N.
    GROUP_TILES > 1 (fused only): tile_counts has one scanned row per group of tiles, and hist (int8) each
    tile's own counts: a row's base adds the counts of the earlier tiles of its group.
    ZERO_GROUPS (fused only, BLOCK_N a multiple of TILE_N * GROUP_TILES): each group row of tile_counts is read
    by exactly one program, which sets it back to zero after its loads, so the next call's gate finds the
    buffer zeroed (no memset launch); num_groups bounds the rows."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    cols_E = tl.arange(0, BLOCK_E)
    is_e_E = cols_E < E
    counts_E = tl.load(counts_ptr + cols_E, mask=is_e_E, other=0).to(tl.int32)
    offsets_E = tl.cumsum(counts_E, axis=0) - counts_E
    num_local = tl.sum(counts_E, axis=0)
    if BLOCK_SIZE > 0:
        padded_E = (counts_E + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    else:
        padded_E = counts_E
    pend_E = tl.cumsum(padded_E, axis=0)  # inclusive: expert e owns padded slots [pend - padded, pend)
    if pid < num_tiles:
        v_B = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_B, key_B, is_row_B = _visit_keys(ids_ptr, order_ptr, v_B, N, E, expert_start, HAS_ORDER)
        is_local_B = key_B >= 0
        keyc_B = tl.where(is_local_B, key_B, 0)
        if HAS_WITHIN:
            within_B = tl.load(within_ptr + (n_B // K) * BLOCK_E + keyc_B, mask=is_row_B, other=0).to(tl.int32)
        else:
            i_B = tl.arange(0, BLOCK_N)
            before_BB = (key_B[:, None] == key_B[None, :]) & (i_B[None, :] < i_B[:, None])
            within_B = tl.sum(tl.where(before_BB, 1, 0), axis=1)  # same key earlier in this tile
        # rows of each key in earlier tiles (launch 2), read back through L1 rather than gathered in registers
        s_B = v_B // TILE_N
        rank_B = tl.load(tile_counts_ptr + (s_B // GROUP_TILES) * BLOCK_E + keyc_B, mask=is_row_B, other=0) + within_B
        for j in tl.static_range(GROUP_TILES - 1):  # earlier tiles of the group (read through L1)
            sj_B = s_B // GROUP_TILES * GROUP_TILES + j
            rank_B += tl.load(hist_ptr + sj_B * BLOCK_E + keyc_B, mask=is_row_B & (sj_B < s_B), other=0).to(tl.int32)
        if WRITE_RANK:
            tl.store(rank_ptr + n_B, tl.where(is_local_B, rank_B, -1).to(tl.int64), mask=is_row_B)
        if WRITE_PERMUTE:
            if HAS_WITHIN:
                dest_B = tl.gather(offsets_E, keyc_B, 0) + rank_B
            else:
                local_before_tile = tl.sum(tl.load(tile_counts_ptr + pid * BLOCK_E + cols_E), axis=0)
                other_rank_B = pid * BLOCK_N - local_before_tile + within_B
                dest_B = tl.where(is_local_B, tl.gather(offsets_E, keyc_B, 0) + rank_B, num_local + other_rank_B)
            w_B = tl.load(weights_ptr + n_B, mask=is_row_B, other=0.0).to(tl.float32)
            tl.store(order_out_ptr + dest_B, n_B.to(tl.int64), mask=is_row_B)
            tl.store(inv_ptr + n_B, dest_B.to(tl.int64), mask=is_row_B)
            tl.store(token_ptr + dest_B, (n_B // K).to(tl.int64), mask=is_row_B)
            tl.store(w_out_ptr + dest_B, tl.where(is_local_B, w_B, 0.0), mask=is_row_B)
            if BLOCK_SIZE > 0:
                slot_B = tl.gather(pend_E - padded_E, keyc_B, 0) + rank_B
                tl.store(sorted_rows_ptr + slot_B, n_B, mask=is_row_B & is_local_B)
        if ZERO_GROUPS:  # this program's group rows, read above (last: fewer values live) and by no other program
            GROUPS: tl.constexpr = BLOCK_N // (TILE_N * GROUP_TILES)
            tl.debug_barrier()  # every thread's loads of tile_counts come first
            g_G = pid * GROUPS + tl.arange(0, GROUPS)
            tl.store(tile_counts_ptr + g_G[:, None] * BLOCK_E + cols_E[None, :], tl.zeros((GROUPS, BLOCK_E), tl.int32),
                     mask=(g_G < num_groups)[:, None])
    if WRITE_PERMUTE:
        if pid == 0:
            tl.store(offsets_ptr + cols_E, offsets_E.to(tl.int64), mask=is_e_E)
            tl.store(offsets_ptr + E, num_local.to(tl.int64))
        if BLOCK_SIZE > 0:
            if pid == 0:
                tl.store(padded_offsets_ptr + cols_E, (pend_E - padded_E).to(tl.int64), mask=is_e_E)
                tl.store(padded_offsets_ptr + E, tl.sum(padded_E, axis=0).to(tl.int64))
                tl.store(num_padded_ptr, tl.sum(padded_E, axis=0))
            b_B = pid * BLOCK_B + tl.arange(0, BLOCK_B)
            pend_cmp_E = tl.where(is_e_E, pend_E, 2147483647)
            e_B = tl.sum(tl.where(pend_cmp_E[None, :] <= (b_B * BLOCK_SIZE)[:, None], 1, 0), axis=1)  # owner
            tl.store(block_expert_ptr + b_B, tl.where(e_B < E, e_B, -1), mask=b_B < num_blocks)
