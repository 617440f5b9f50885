"""Persistent variants of the fused MoE GEMMs (prefill): one program per SM walks the live tiles.

The tile GEMMs of `fused_moe_gemm.py` run one program per output tile. At prefill shapes a 128 x 256
tile takes a whole SM, so each program's pipeline fill (the first stages of loads) and its epilogue
(SiLU * up or the routing weight, and the store) run with the tensor cores idle. Here a fixed grid of
programs (about one per SM) loops over the tiles p, p + NUM_PROGRAMS, ... below num_padded / BLOCK_M
(read on the device: the grid stays static, CUDA-graph capturable). With FLATTEN, Triton flattens the
tile loop and the K loop into one software-pipelined loop, so the loads of a program's next tile are
in flight while it finishes the last one.

Same arithmetic per tile as gate_up_kernel / down_kernel (same K order, same fp32 accumulators), so
the same bits; only the tiles' order over the SMs differs. The schedule must not be inline (decode)
and the down GEMM writes y_ND (the "kernel" combine runs after it).

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k, N = T*K routed rows,
P padded slots, B tiles.
"""
import triton
import triton.language as tl

from moe_infer.kernels.fused_moe_gemm import gate_up_one_dot, gate_up_two_dot, tile_of
from moe_infer.kernels.pdl import pdl_enter


@triton.jit
def gate_up_persistent_kernel(x_ptr, w13_ptr, act_ptr, sorted_ptr, expert_ptr, num_padded_ptr,
                              num_rows, ROW_DIV, D, F, stride_xm, stride_we, stride_wn, stride_wk, stride_am,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, IS_FP32_DOT: tl.constexpr, USE_TMA: tl.constexpr,
                              DOT_PRECISION: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
                              USE_PDL: tl.constexpr, GATHERED: tl.constexpr = False, ONE_DOT: tl.constexpr = False):
    """act_PF[p] = silu(x[row_p // ROW_DIV] @ w1_e.T) * (x[..] @ w3_e.T) for every live tile (see gate_up_kernel).

    USE_TMA: w13_ptr is a tensor descriptor over w13 viewed [E*2F, D] with block [BLOCK_N, BLOCK_K];
    ONE_DOT (with USE_TMA): over w13 viewed [E, 2, F, D] (`gate_up_one_dot`).
    """
    pdl_enter(USE_PDL)
    num_tiles_m = tl.load(num_padded_ptr) // BLOCK_M  # every expert's rows are padded to BLOCK_M
    num_tiles_n = tl.cdiv(F, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles_m * num_tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = tile_of(tile, num_tiles_m, num_tiles_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(sorted_ptr + offs_m)  # a pad slot holds N (num_rows): its row reads zeros
        is_row = rows < num_rows
        e = tl.load(expert_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        is_n = offs_n < F
        if GATHERED:  # x_ptr: a tensor descriptor over the rows already in slot order, x_PD [P, D]
            a_src = x_ptr
        else:
            a_src = x_ptr + (rows // ROW_DIV).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        if ONE_DOT:
            acc_g, acc_u = gate_up_one_dot(a_src, is_row, w13_ptr, e, pid_n, D, BLOCK_M, BLOCK_N, BLOCK_K,
                                           IS_FP32_DOT, DOT_PRECISION)
        else:
            acc_g, acc_u = gate_up_two_dot(a_src, is_row, w13_ptr, e, pid_m, pid_n, D, F,
                                           stride_we, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IS_FP32_DOT,
                                           USE_TMA, DOT_PRECISION, CARRY=False, GATHERED=GATHERED)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        out_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=is_n[None, :])


@triton.jit
def down_persistent_kernel(act_ptr, w2_ptr, y_ptr, weights_ptr, sorted_ptr, expert_ptr, num_padded_ptr,
                           num_rows, D, F, stride_am, stride_we, stride_wn, stride_wk, stride_ym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, IS_FP32_DOT: tl.constexpr, USE_TMA: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
                           USE_PDL: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False):
    """y[row_p] = weights[row_p] * act_PF[p] @ w2_e.T for every real row p of a live tile (see down_kernel).

    USE_TMA: act_ptr and w2_ptr are tensor descriptors over act_PF [P, F] (block [BLOCK_M, BLOCK_K])
    and w2 viewed [E*D, F] (block [BLOCK_N, BLOCK_K]).
    WARP_SPECIALIZE (with USE_TMA): the tile loop split by Triton into load and compute warps (GemmConfig).
    """
    pdl_enter(USE_PDL)
    num_tiles_m = tl.load(num_padded_ptr) // BLOCK_M
    num_tiles_n = tl.cdiv(D, BLOCK_N)
    num_k = tl.cdiv(F, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles_m * num_tiles_n, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_of(tile, num_tiles_m, num_tiles_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        e = tl.load(expert_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        is_n = offs_n < D
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, num_k):
            if USE_TMA:  # rows past D read the next expert; they land in masked-out outputs
                a = act_ptr.load([pid_m * BLOCK_M, k * BLOCK_K])
                w = w2_ptr.load([(e * D).to(tl.int32) + pid_n * BLOCK_N, k * BLOCK_K]).T
            else:
                k_left = F - k * BLOCK_K
                a = tl.load(act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + k * BLOCK_K + offs_k[None, :],
                            mask=offs_k[None, :] < k_left, other=0.0)
                w = tl.load(w2_ptr + e * stride_we + offs_n[None, :] * stride_wn + (k * BLOCK_K + offs_k)[:, None] * stride_wk,
                            mask=(offs_k[:, None] < k_left) & is_n[None, :], other=0.0)
            if IS_FP32_DOT:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        rows = tl.load(sorted_ptr + offs_m)
        is_row = rows < num_rows
        weight = tl.load(weights_ptr + rows, mask=is_row, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        out_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=is_row[:, None] & is_n[None, :])
