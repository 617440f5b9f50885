"""Raw Triton kernels of the fused MoE path: gate_up GEMM + SiLU*up, down GEMM + routing weight,
and the top-k combine.

Both GEMMs walk the block-padded schedule of `fused_moe_align` (sorted_P, expert_B, num_padded),
read from memory or, for decode (INLINE), derived from ids_N inside each program (`tile_rows`):
tile b holds BLOCK_M slots of one expert; tiles past num_padded exit at once, so the grid is
static (CUDA-graph capturable) and non-local rows cost nothing. The gate_up GEMM reads its rows
straight from the source activations (x_TD through row // ROW_DIV), so no gathered copy exists;
the down GEMM scales each row by its routing weight and writes it at its routed row n.
Tiles are ordered in groups of GROUP_M along M (L2 reuse of weight tiles in the prefill shape).
IS_FP32_DOT upcasts operands before tl.dot (the CPU interpreter's bf16 dot is wrong);
DOT_PRECISION is "ieee" for float32 operands (no TF32), "tf32" (ignored) for bf16/fp16.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k, N = T*K routed rows,
P padded slots, B tiles.
"""
import triton
import triton.language as tl

from moe_infer.kernels.fused_moe_align import tile_rows
from moe_infer.kernels.moe_epilogue_kernels import down_epilogue, gate_up_epilogue
from moe_infer.kernels.pdl import pdl_enter


@triton.jit
def tile_of(tile, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile `tile`: groups of GROUP_M row tiles, column-major inside a group."""
    group = GROUP_M * num_tiles_n
    first_m = (tile // group) * GROUP_M
    size_m = min(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % size_m
    pid_n = (tile % group) // size_m
    return pid_m, pid_n


@triton.jit
def gate_up_one_dot(a_ptrs, is_row, w13_desc, e, pid_n, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IS_FP32_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(acc_g, acc_u) [BLOCK_M, BLOCK_N] of one tile, as one dot: w13_desc is a tensor descriptor over w13
    viewed [E, 2, F, D] with block [1, 2, BLOCK_N, BLOCK_K], so one load brings the gate and the up tile
    together ([2 BLOCK_N, BLOCK_K] in shared memory) and one [BLOCK_M, 2 BLOCK_N] accumulator takes both
    (measured faster than two dots into two accumulators; columns past F read zeros). The same K order,
    so the same bits."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        a = tl.load(a_ptrs + k * BLOCK_K, mask=is_row[:, None] & (offs_k[None, :] < D - k * BLOCK_K), other=0.0)
        w = tl.reshape(w13_desc.load([e.to(tl.int32), 0, pid_n * BLOCK_N, k * BLOCK_K]), [2 * BLOCK_N, BLOCK_K]).T
        if IS_FP32_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))


@triton.jit
def gate_up_two_dot(a_src, is_row, w13, e, pid_m, pid_n, D, F, stride_we, stride_wn, stride_wk,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_FP32_DOT: tl.constexpr,
                    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, CARRY: tl.constexpr,
                    GATHERED: tl.constexpr = False):
    """(acc_g, acc_u) [BLOCK_M, BLOCK_N] of one tile, a dot each into its own accumulator. a_src: the tile's
    row pointers into x at column 0, or (GATHERED) a tensor descriptor over the rows already in slot order
    ([P, D], block [BLOCK_M, BLOCK_K]); w13: w13_E2FD, or (USE_TMA) a tensor descriptor over it viewed
    [E*2F, D] with block [BLOCK_N, BLOCK_K] (columns past F then read the next rows; they land in masked-out
    outputs). CARRY (the per-tile kernel): the loop-invariant parts are set up before the K loop and the
    pointers step from one K block to the next; otherwise (the persistent kernel's flattened loop) they are
    computed from k. So each kernel compiles to the PTX it had as its own copy before this helper
    (benchmarks/trials/gate_up_ptx_compare.py; no speed difference between the two ways was measured,
    benchmarks/trials/gate_up_body_ab.py), and K runs in order, so the same bits."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_n = offs_n < F
    if CARRY:  # the per-tile kernel: what does not change along K is set up before the loop
        a_ptrs = a_src
        if USE_TMA:
            g_row = (e * 2 * F).to(tl.int32) + pid_n * BLOCK_N
        else:
            w_base = w13 + e * stride_we + offs_k[:, None] * stride_wk
            g_ptrs = w_base + offs_n[None, :] * stride_wn
            u_ptrs = w_base + (offs_n + F)[None, :] * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        k_left = D - k * BLOCK_K
        if GATHERED:
            a = a_src.load([pid_m * BLOCK_M, k * BLOCK_K])
        elif CARRY:
            a = tl.load(a_ptrs, mask=is_row[:, None] & (offs_k[None, :] < k_left), other=0.0)
        else:
            a = tl.load(a_src + k * BLOCK_K, mask=is_row[:, None] & (offs_k[None, :] < k_left), other=0.0)
        if USE_TMA:
            if not CARRY:
                g_row = (e * 2 * F).to(tl.int32) + pid_n * BLOCK_N
            g = w13.load([g_row, k * BLOCK_K]).T
            u = w13.load([g_row + F, k * BLOCK_K]).T
        else:
            w_mask = (offs_k[:, None] < k_left) & is_n[None, :]
            if CARRY:
                g = tl.load(g_ptrs, mask=w_mask, other=0.0)
                u = tl.load(u_ptrs, mask=w_mask, other=0.0)
                g_ptrs += BLOCK_K * stride_wk
                u_ptrs += BLOCK_K * stride_wk
            else:
                w_k = w13 + e * stride_we + (k * BLOCK_K + offs_k)[:, None] * stride_wk
                g = tl.load(w_k + offs_n[None, :] * stride_wn, mask=w_mask, other=0.0)
                u = tl.load(w_k + (offs_n + F)[None, :] * stride_wn, mask=w_mask, other=0.0)
        if IS_FP32_DOT:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        if CARRY:
            a_ptrs += BLOCK_K
    return acc_g, acc_u


@triton.jit  # num_rows, num_tiles_m stay specialized: see launch_variant (fused_moe.py)
def gate_up_kernel(x_ptr, w13_ptr, act_ptr, sorted_ptr, expert_ptr, num_padded_ptr,
                   num_rows, ROW_DIV, D, F, num_tiles_m, expert_start, E,
                   stride_xm, stride_we, stride_wn, stride_wk, stride_am,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, IS_FP32_DOT: tl.constexpr, USE_TMA: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, INLINE: tl.constexpr, N_PAD: tl.constexpr,
                   E_PAD: tl.constexpr, USE_PDL: tl.constexpr, ONE_DOT: tl.constexpr = False,
                   b13_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False,
                   ALPHA: tl.constexpr = 1.702, LIMIT: tl.constexpr = 7.0):
    """act_PF[p] = silu(x[row_p // ROW_DIV] @ w1_e.T) * (x[..] @ w3_e.T), e = expert of p's tile (HAS_BIAS, CLAMPED:
    the gate/up bias b13 [E, 2F] and GPT-OSS's clamped SwiGLU, moe_epilogue.py).

    USE_TMA: w13_ptr is a tensor descriptor over w13 viewed [E*2F, D] with block [BLOCK_N, BLOCK_K];
    ONE_DOT (with USE_TMA): over w13 viewed [E, 2, F, D], see `gate_up_one_dot`.
    """
    pdl_enter(USE_PDL)
    pid_m, pid_n = tile_of(tl.program_id(0), num_tiles_m, tl.cdiv(F, BLOCK_N), GROUP_M)
    num_padded, rows, e = tile_rows(pid_m, sorted_ptr, expert_ptr, num_padded_ptr, num_rows, expert_start, E,
                                    BLOCK_M, INLINE, N_PAD, E_PAD)
    if pid_m * BLOCK_M >= num_padded:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    is_row = rows < num_rows
    e = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (rows // ROW_DIV).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    is_n = offs_n < F
    if ONE_DOT:
        acc_g, acc_u = gate_up_one_dot(a_ptrs, is_row, w13_ptr, e, pid_n, D, BLOCK_M, BLOCK_N, BLOCK_K,
                                       IS_FP32_DOT, DOT_PRECISION)
    else:
        acc_g, acc_u = gate_up_two_dot(a_ptrs, is_row, w13_ptr, e, pid_m, pid_n, D, F, stride_we, stride_wn, stride_wk,
                                       BLOCK_M, BLOCK_N, BLOCK_K, IS_FP32_DOT, USE_TMA, DOT_PRECISION, CARRY=True)
    act = gate_up_epilogue(acc_g, acc_u, b13_ptr, e, offs_n, is_n, F, stride_be, HAS_BIAS, CLAMPED, ALPHA, LIMIT)
    out_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=is_n[None, :])


@triton.jit  # num_rows, num_tiles_m stay specialized: see launch_variant (fused_moe.py)
def down_kernel(act_ptr, w2_ptr, y_ptr, weights_ptr, sorted_ptr, expert_ptr, num_padded_ptr,
                out_ptr, ids_ptr, count_ptr,
                num_rows, D, F, num_tiles_m, expert_start, E,
                stride_am, stride_we, stride_wn, stride_wk, stride_ym, stride_ot,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, IS_FP32_DOT: tl.constexpr, USE_TMA: tl.constexpr,
                DOT_PRECISION: tl.constexpr, INLINE: tl.constexpr, N_PAD: tl.constexpr,
                E_PAD: tl.constexpr, COMBINE_TAIL: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                USE_PDL: tl.constexpr, b2_ptr=None, stride_b2e=0, HAS_BIAS2: tl.constexpr = False):
    """y[row_p] = weights[row_p] * act_PF[p] @ w2_e.T for every real row p of a live tile (HAS_BIAS2: weights[row_p]
    * (act_PF[p] @ w2_e.T + b2[e]), the down bias b2 [E, D]).

    USE_TMA: act_ptr and w2_ptr are tensor descriptors over act_PF [P, F] (block [BLOCK_M, BLOCK_K])
    and w2 viewed [E*D, F] (block [BLOCK_N, BLOCK_K]).
    COMBINE_TAIL: also the top-k combine (`_combine_tail`); out_ptr [T, D] must hold zeros for tokens
    without a local row and count_ptr [T, cdiv(D, BLOCK_N)] zeros.
    """
    pdl_enter(USE_PDL)
    pid_m, pid_n = tile_of(tl.program_id(0), num_tiles_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    num_padded, rows, e = tile_rows(pid_m, sorted_ptr, expert_ptr, num_padded_ptr, num_rows, expert_start, E,
                                    BLOCK_M, INLINE, N_PAD, E_PAD)
    if pid_m * BLOCK_M >= num_padded:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    is_row = rows < num_rows
    e = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if USE_TMA:
        w_row = (e * D).to(tl.int32) + pid_n * BLOCK_N
    else:
        a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w2_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    is_n = offs_n < D
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(F, BLOCK_K)):
        if USE_TMA:  # rows past D read the next expert; they land in masked-out outputs
            a = act_ptr.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w2_ptr.load([w_row, k * BLOCK_K]).T
        else:
            k_left = F - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & is_n[None, :], other=0.0)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        if IS_FP32_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    acc = down_epilogue(acc, b2_ptr, e, offs_n, is_n, stride_b2e, HAS_BIAS2)
    weight = tl.load(weights_ptr + rows, mask=is_row, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=is_row[:, None] & is_n[None, :])
    if COMBINE_TAIL:
        _combine_tail(y_ptr, out_ptr, ids_ptr, count_ptr, rows, is_row, offs_n, is_n, pid_n, tl.cdiv(D, BLOCK_N),
                      expert_start, E, stride_ym, stride_ot, BLOCK_M, BLOCK_N, TOP_K, K_PAD)


@triton.jit
def _combine_tail(y_ptr, out_ptr, ids_ptr, count_ptr, rows, is_row, offs_n, is_n, pid_n, num_tiles_n,
                  expert_start, E, stride_ym, stride_ot,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    """The top-k combine in the down GEMM's epilogue, overlapped with other tiles' GEMM work.

    Each program, after storing its y rows, counts them per (token, column tile) with one atomic
    each; the program that stores the last local row of a token sums that token's local rows
    (k = 0..K-1, fp32, the order of `combine_kernel`, so the same bits) into out. The stores
    before the count are released to the program that reads them (barrier + acq_rel atomics);
    the reads go through L2 (.cg)."""
    tl.debug_barrier()
    tok = rows // TOP_K
    count_ptrs = count_ptr + tok.to(tl.int64) * num_tiles_n + pid_n
    num_before = tl.atomic_add(count_ptrs, tl.full([BLOCK_M], 1, tl.int32), mask=is_row, sem="acq_rel", scope="gpu")
    kk = tl.arange(0, K_PAD)
    ids_MK = tl.load(ids_ptr + tok.to(tl.int64)[:, None] * TOP_K + kk[None, :],
                     mask=is_row[:, None] & (kk[None, :] < TOP_K), other=-1).to(tl.int32)
    key_MK = ids_MK - expert_start
    num_local = tl.sum(((ids_MK >= 0) & (key_MK >= 0) & (key_MK < E)).to(tl.int32), axis=1)
    is_last = is_row & (num_before == num_local - 1)
    tl.debug_barrier()
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        id_k = tl.sum(tl.where(kk[None, :] == k, ids_MK, 0), axis=1)
        key_k = id_k - expert_start
        is_k = is_last & (id_k >= 0) & (key_k >= 0) & (key_k < E)
        y = tl.load(y_ptr + (tok * TOP_K + k).to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
                    mask=is_k[:, None] & is_n[None, :], other=0.0, cache_modifier=".cg")
        total += y.to(tl.float32)
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], total.to(out_ptr.dtype.element_ty),
             mask=is_last[:, None] & is_n[None, :])


@triton.jit
def combine_kernel(y_ptr, ids_ptr, out_ptr, D, expert_start, E, stride_ym, stride_ot,
                   K: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """out_TD[t] = sum_k y_ND[t*K + k] over the k whose expert is local (others were never written)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    is_d = offs_d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):  # masks, not branches: the K row loads are in flight together
        expert = tl.load(ids_ptr + t * K + k).to(tl.int32)
        key = expert - expert_start
        num_d = tl.where((expert >= 0) & (key >= 0) & (key < E), D, 0)  # no columns for a row that is not local
        y = tl.load(y_ptr + (t * K + k) * stride_ym + offs_d, mask=offs_d < num_d, other=0.0)
        acc += y.to(tl.float32)  # + 0.0 for a row that is not local: the same bits as skipping it
    tl.store(out_ptr + t * stride_ot + offs_d, acc.to(out_ptr.dtype.element_ty), mask=is_d)
