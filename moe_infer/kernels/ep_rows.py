"""Raw Triton kernels of the expert-parallel row path (wrappers and checks: `moe_infer.kernels.ep_ops`;
PyTorch references of the same signatures: `moe_infer.kernels.ep_ops_torch`).

    slot_rows_kernel     routed row n -> send row dest_N[n] = slot(n) * C + rank(n) (X if not sent)
                         and the inverse map src_X[dest] = n (prefilled with -1)
    pack_rows_kernel     send_XC[x] = [x_TD[src_X[x] // K], bits of weights_N[src_X[x]]] (zeros if src < 0)
    slot_pack_kernel     the three steps before the all-to-all in one launch (replica choice, rank in the
                         slot, dest_N, the packed send rows): one program per virtual slot, which scans
                         all N routed rows (for few rows: `moe_infer.kernels.ep_row_ops.SLOT_PACK_MAX_ROWS`)
    recv_rows_kernel     received row x -> (local slot if its weight != 0 else -1, its float32 weight)
    combine_rows_kernel  out_TD[t] = sum_k y_XD[dest_N[t*K + k]] in float32 (rows dest >= X add nothing)

Legend: T tokens, D hidden, K top-k, N = T*K routed rows, V slots, C capacity rows per slot,
X rows of the send / receive buffer, W weight columns (float32 bits in the payload's dtype).
Rows are only moved here, never computed on: the interpreter's bf16 arithmetic is not used.
"""
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter


@triton.jit(do_not_specialize=["N", "C", "X"])
def slot_rows_kernel(ids_ptr, rank_ptr, table_ptr, dest_ptr, src_ptr, N, C, X, BLOCK_N: tl.constexpr):
    n_B = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row_B = n_B < N
    id_B = tl.load(ids_ptr + n_B, mask=is_row_B, other=-1).to(tl.int64)
    rank_B = tl.load(rank_ptr + n_B, mask=is_row_B, other=-1).to(tl.int64)
    is_valid_B = is_row_B & (id_B >= 0)
    slot_B = tl.load(table_ptr + tl.maximum(id_B, 0), mask=is_valid_B, other=0).to(tl.int64)
    is_kept_B = is_valid_B & (rank_B >= 0) & (rank_B < C)
    dest_B = tl.where(is_kept_B, slot_B * C + rank_B, X)
    tl.store(dest_ptr + n_B, dest_B, mask=is_row_B)
    tl.store(src_ptr + dest_B, n_B.to(tl.int32), mask=is_kept_B)


@triton.jit
def pack_rows_kernel(x_ptr, w_ptr, src_ptr, out_ptr, out_w_ptr, D, K, stride_x, stride_o, stride_ow, w_col,
                     BLOCK_D: tl.constexpr):
    """grid (X, cdiv(D, BLOCK_D)); out_w_ptr: the same buffer seen as float32 (row stride stride_ow)."""
    row = tl.program_id(0).to(tl.int64)
    d_B = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    is_d_B = d_B < D
    src_B = tl.load(src_ptr + row + tl.zeros([BLOCK_D], dtype=tl.int64)).to(tl.int64)  # one value, broadcast
    is_src_B = src_B >= 0
    tok_B = tl.maximum(src_B, 0) // K
    vals_B = tl.load(x_ptr + tok_B * stride_x + d_B, mask=is_d_B & is_src_B, other=0.0)
    tl.store(out_ptr + row * stride_o + d_B, vals_B, mask=is_d_B)
    if tl.program_id(1) == 0:  # the weight, as a 2-vector (lane 0) so that the masks are tensors
        lane_2 = tl.arange(0, 2)
        src_2 = tl.load(src_ptr + row + lane_2 * 0).to(tl.int64)
        w_2 = tl.load(w_ptr + tl.maximum(src_2, 0), mask=(lane_2 == 0) & (src_2 >= 0), other=0.0)
        tl.store(out_w_ptr + row * stride_ow + w_col + lane_2, w_2, mask=lane_2 == 0)


@triton.jit(do_not_specialize=["X"])
def recv_rows_kernel(recv_w_ptr, slot_ptr, ids_ptr, w_ptr, X, stride_w, w_col, BLOCK_X: tl.constexpr):
    x_B = tl.program_id(0) * BLOCK_X + tl.arange(0, BLOCK_X)
    is_row_B = x_B < X
    w_B = tl.load(recv_w_ptr + x_B.to(tl.int64) * stride_w + w_col, mask=is_row_B, other=0.0)
    slot_B = tl.load(slot_ptr + x_B, mask=is_row_B, other=0).to(tl.int32)
    tl.store(ids_ptr + x_B, tl.where(w_B != 0.0, slot_B, -1), mask=is_row_B)
    tl.store(w_ptr + x_B, w_B, mask=is_row_B)


@triton.jit(do_not_specialize=["X"])
def combine_rows_kernel(y_ptr, dest_ptr, out_ptr, D, X, stride_y, stride_o, K: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (T, cdiv(D, BLOCK_D))."""
    t = tl.program_id(0).to(tl.int64)
    d_B = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    is_d_B = d_B < D
    acc_B = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):  # masks, not branches: the K row loads are in flight together
        dest = tl.load(dest_ptr + t * K + k).to(tl.int64)
        num_d = tl.where(dest < X, D, 0)  # no columns for a row that was not sent
        y_B = tl.load(y_ptr + tl.minimum(dest, X - 1) * stride_y + d_B, mask=d_B < num_d, other=0.0)
        acc_B += y_B.to(tl.float32)  # + 0.0 for a row not sent: the same bits as skipping it (acc starts at +0)
    tl.store(out_ptr + t * stride_o + d_B, acc_B.to(out_ptr.dtype.element_ty), mask=is_d_B)


@triton.jit(do_not_specialize=["N", "C", "X", "v_start"])
def slot_pack_kernel(ids_ptr, slots_ptr, x_ptr, w_ptr, dest_ptr, src_ptr, out_ptr, out_w_ptr,
                     N, C, X, D, K, ep_rank, v_start, stride_x, stride_o, stride_ow, w_col,
                     BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """grid (V_m,): program i handles virtual slot v = v_start + i, send rows [v*C, (v+1)*C) of the whole
    buffer (X rows), rows [i*C, (i+1)*C) of out_ptr (a section). slots_ptr (int32 [V, 3]): v's logical expert
    e, its replica index j and e's number of replicas M; routed row n (id e) goes to v when
    (n + ep_rank) % M == j, ranked among v's rows in row order; dest_N[n] = v*C + rank (X over capacity).
    Slot 0's program also gives dropped rows (id < 0) dest X. src_ptr: int32 scratch [V_m * C], each
    program's rows written, then read back after a barrier (same program only)."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    v = v_start + pid
    e_v = tl.load(slots_ptr + v * 3)
    j_v = tl.load(slots_ptr + v * 3 + 1)
    m_v = tl.load(slots_ptr + v * 3 + 2)
    row0 = v.to(tl.int64) * C  # the slot's first row in the whole send buffer
    loc0 = pid.to(tl.int64) * C  # ... in this section
    i_B = tl.arange(0, BLOCK_N)
    is_first_B = (i_B * 0 + v) == 0  # a tensor: the interpreter rejects scalar-and-vector bool masks
    count = pid * 0  # rows of v so far (an int32 scalar)
    for n0 in range(0, N, BLOCK_N):
        n_B = n0 + i_B
        is_row_B = n_B < N
        id_B = tl.load(ids_ptr + n_B, mask=is_row_B, other=-1).to(tl.int32)
        is_match_B = is_row_B & (id_B == e_v)
        if m_v > 1:  # a replicated expert: its rows go round-robin over the replicas (no modulo otherwise)
            is_match_B = is_match_B & ((n_B + ep_rank) % m_v == j_v)
        m_B = is_match_B.to(tl.int32)
        rank_B = count + tl.cumsum(m_B, axis=0) - m_B
        is_kept_B = is_match_B & (rank_B < C)
        tl.store(dest_ptr + n_B, tl.where(is_kept_B, row0 + rank_B, X),
                 mask=is_match_B | (is_row_B & (id_B < 0) & is_first_B))
        tl.store(src_ptr + loc0 + rank_B, n_B, mask=is_kept_B)
        count += tl.sum(m_B, axis=0)
    tl.debug_barrier()  # the src entries above, from every thread of the program, are read back below
    for c0 in range(0, C, BLOCK_C):
        i_C = c0 + tl.arange(0, BLOCK_C)
        is_c_C = i_C < C
        has_C = is_c_C & (i_C < count)  # an empty capacity row gets zeros
        src_C = tl.load(src_ptr + loc0 + i_C, mask=has_C, other=0, volatile=True).to(tl.int64)
        tok_C = src_C // K
        out_C = loc0 + i_C
        for d0 in range(0, D, BLOCK_D):
            d_D = d0 + tl.arange(0, BLOCK_D)
            is_d_D = d_D < D
            vals_CD = tl.load(x_ptr + tok_C[:, None] * stride_x + d_D[None, :], mask=has_C[:, None] & is_d_D[None, :],
                              other=0.0)
            tl.store(out_ptr + out_C[:, None] * stride_o + d_D[None, :], vals_CD, mask=is_c_C[:, None] & is_d_D[None, :])
        w_C = tl.load(w_ptr + src_C, mask=has_C, other=0.0)
        tl.store(out_w_ptr + out_C * stride_ow + w_col, w_C, mask=is_c_C)
