"""Raw Triton kernels of the capacity policies (wrappers: `moe_infer.routing.triton_capacity`).

Legend: T tokens, E experts, K top-k, N = T*K rows, V visiting positions (v -> row order[v]).
`drop_rows_kernel`: per token, rows ranked >= capacity become id -1 / weight 0, kept weights are
rescaled to the token's original total when RENORMALIZE. `reroute_kernel`: one program walks the
rows in visiting order and moves each dropped row to its token's best free expert; the per-expert
room lives in registers, so the walk is sequential by definition (the policy's semantics).
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "capacity"])
def drop_rows_kernel(
    ids_ptr, w_ptr, rank_ptr, out_ids_ptr, out_w_ptr, T, capacity,
    K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t_B = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k_K = tl.arange(0, BLOCK_K)
    mask_BK = (t_B[:, None] < T) & (k_K[None, :] < K)
    offs_BK = t_B[:, None] * K + k_K[None, :]
    id_BK = tl.load(ids_ptr + offs_BK, mask=mask_BK, other=-1).to(tl.int32)
    w_BK = tl.load(w_ptr + offs_BK, mask=mask_BK, other=0.0).to(tl.float32)
    rank_BK = tl.load(rank_ptr + offs_BK, mask=mask_BK, other=0)
    keep_BK = (rank_BK < capacity) & (id_BK >= 0) & mask_BK
    kept_w_BK = tl.where(keep_BK, w_BK, 0.0)
    if RENORMALIZE:
        kept_B = tl.sum(kept_w_BK, axis=1)
        scale_B = tl.where(kept_B > 0, tl.sum(w_BK, axis=1) / tl.maximum(kept_B, 1e-30), 0.0)
        kept_w_BK = kept_w_BK * scale_B[:, None]
    tl.store(out_ids_ptr + offs_BK, tl.where(keep_BK, id_BK, -1), mask=mask_BK)
    tl.store(out_w_ptr + offs_BK, kept_w_BK, mask=mask_BK)


@triton.jit(do_not_specialize=["N", "capacity"])
def reroute_kernel(
    ids_ptr, topk_ids_ptr, choice_ptr, counts_ptr, order_ptr, N, E, capacity,
    K: tl.constexpr, HAS_ORDER: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """ids_ptr [T, K] int32: kept ids (-1 dropped), rewritten in place. grid = (1,)."""
    cols_E = tl.arange(0, BLOCK_E)
    is_e_E = cols_E < E
    counts_E = tl.load(counts_ptr + cols_E, mask=is_e_E, other=0).to(tl.int32)
    room_E = tl.where(is_e_E, capacity - tl.minimum(counts_E, capacity), 0)
    i_V = tl.arange(0, BLOCK_V)
    k_K = tl.arange(0, BLOCK_K)
    for v0 in range(0, N, BLOCK_V):
        v_V = v0 + i_V
        is_row_V = v_V < N
        if HAS_ORDER:
            n_V = tl.load(order_ptr + v_V, mask=is_row_V, other=0).to(tl.int32)
        else:
            n_V = v_V
        orig_V = tl.load(topk_ids_ptr + n_V, mask=is_row_V, other=-1)
        kept_V = tl.load(ids_ptr + n_V, mask=is_row_V, other=0, volatile=True)
        dropped_V = is_row_V & (orig_V >= 0) & (kept_V < 0)
        if tl.sum(dropped_V.to(tl.int32), axis=0) > 0:
            for i in range(BLOCK_V):
                is_dropped = tl.sum(tl.where((i_V == i) & dropped_V, 1, 0), axis=0)
                if is_dropped > 0:
                    n = tl.sum(tl.where(i_V == i, n_V, 0), axis=0)
                    t = n // K
                    used_K = tl.load(ids_ptr + t * K + k_K, mask=k_K < K, other=-1, volatile=True)
                    is_used_E = tl.sum(tl.where(used_K[:, None] == cols_E[None, :], 1, 0), axis=0) > 0
                    s_E = tl.load(choice_ptr + t.to(tl.int64) * E + cols_E, mask=is_e_E, other=0.0)
                    cand_E = (room_E > 0) & ~is_used_E & is_e_E
                    m = tl.max(tl.where(cand_E, s_E, float("-inf")), axis=0)
                    best = tl.min(tl.where(cand_E & (s_E == m), cols_E, BLOCK_E), axis=0)
                    if best < BLOCK_E:
                        tl.store(ids_ptr + n, best)
                        room_E = tl.where(cols_E == best, room_E - 1, room_E)
                    tl.debug_barrier()  # the store above is read back by later rows of the same token
