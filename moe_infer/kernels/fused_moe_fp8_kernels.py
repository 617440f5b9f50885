"""Raw Triton kernels of the block-scaled FP8 (W8A8) fused MoE: gate_up GEMM with SiLU*up and the
intermediate's quantization in its epilogue, and the down GEMM with the routing weight (wrappers:
fused_moe_fp8.py; reference: fp8_ref.fused_moe_fp8_ref).

Both walk the block-padded schedule of fused_moe_align (sorted_P, expert_B, num_padded; `tile_rows`): a
tile of BLOCK_M padded slots belongs to one expert, tiles past num_padded exit at once (static grid).
The K tile is the scale group (BLOCK_K = block_k): per K step, one x scale a row and one w scale a column,
    acc += dot(a_fp8, w_fp8^T) * a_scale[:, None] * w_scale[None, :]       (float32)
gate_up's column tile is one group of the intermediate (BLOCK_N = block_k), so its epilogue quantizes
act = silu(gate) * up per (slot, group) from float32, as the reference does, and writes fp8 + scales.
DOT_UPCAST: see fp8_kernels.py (0 fp8, 1 bf16, 2 float32 under the interpreter).

Legend: T tokens, D hidden, F expert intermediate, E experts, K top-k, N = T*K routed rows, P padded
slots, Gd = D / BLOCK_K and Gf = F / BLOCK_K scale groups, f/d scale blocks of w13/w2 rows.
"""
import triton
import triton.language as tl

from moe_infer.kernels.fp8_kernels import dot_operands, group_scale, grouped_tile, quant_e4m3
from moe_infer.kernels.fused_moe_align import tile_rows


@triton.jit(do_not_specialize=["num_rows", "num_tiles_m"])
def gate_up_fp8_kernel(x_ptr, xs_ptr, w13_ptr, w13s_ptr, act_ptr, acts_ptr, sorted_ptr, expert_ptr,
                       num_padded_ptr, num_rows, ROW_DIV, D, F, num_tiles_m, E,
                       stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn,
                       stride_ap, stride_asp,
                       SCALE_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_UPCAST: tl.constexpr,
                       FP8_MAX: tl.constexpr, SCALE_EPS: tl.constexpr, EXACT_RNE: tl.constexpr):
    """act_PF[p], acts_PGf[p] = quant(silu(g) * u) with g, u = W8A8 x[row_p // ROW_DIV] @ w1_e^T, w3_e^T.

    x_TD fp8 with xs_TGd its scales; w13 [E, 2F, D] fp8 with w13s [E, ceil(2F / SCALE_BLOCK_N), Gd];
    BLOCK_N == BLOCK_K and F % BLOCK_N == 0 (the wrapper checks): column tile pid_n is group pid_n."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_tiles_m, F // BLOCK_N, GROUP_M)
    num_padded, rows, e = tile_rows(pid_m, sorted_ptr, expert_ptr, num_padded_ptr, num_rows, 0, E,
                                    BLOCK_M, False, 16, 16)
    if pid_m * BLOCK_M >= num_padded:
        return
    is_row = rows < num_rows
    tok = (rows // ROW_DIV).to(tl.int64)
    e = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows; up rows are offs_n + F
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w13_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + F * stride_wn
    as_ptrs = xs_ptr + tok * stride_xst
    gs_ptrs = w13s_ptr + e * stride_wse + (offs_n // SCALE_BLOCK_N) * stride_wsn
    us_ptrs = w13s_ptr + e * stride_wse + ((offs_n + F) // SCALE_BLOCK_N) * stride_wsn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, D // BLOCK_K):
        a = tl.load(a_ptrs, mask=is_row[:, None], other=0.0)
        g = tl.load(g_ptrs)
        u = tl.load(u_ptrs)
        a_s = tl.load(as_ptrs + kb, mask=is_row, other=0.0)
        g_s = tl.load(gs_ptrs + kb)
        u_s = tl.load(us_ptrs + kb)
        a, g = dot_operands(a, g, DOT_UPCAST)
        a, u = dot_operands(a, u, DOT_UPCAST)
        acc_g += tl.dot(a, g) * a_s[:, None] * g_s[None, :]
        acc_u += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g * tl.sigmoid(acc_g) * acc_u  # pad slots: 0 (their a rows were zeros)
    scale = group_scale(tl.max(tl.abs(act), axis=1), FP8_MAX, SCALE_EPS)
    offs_p = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    act_fp8 = quant_e4m3(act, scale[:, None], FP8_MAX, EXACT_RNE)
    tl.store(act_ptr + offs_p[:, None] * stride_ap + offs_n[None, :], act_fp8)
    tl.store(acts_ptr + offs_p * stride_asp + pid_n, scale)


@triton.jit(do_not_specialize=["num_rows", "num_tiles_m"])
def down_fp8_kernel(act_ptr, acts_ptr, w2_ptr, w2s_ptr, y_ptr, weights_ptr, sorted_ptr, expert_ptr,
                    num_padded_ptr, num_rows, D, F, num_tiles_m, E,
                    stride_ap, stride_asp, stride_we, stride_wn, stride_wse, stride_wsn, stride_yn,
                    SCALE_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """y_ND[row_p] = weights_N[row_p] * W8A8 act_PF[p] @ w2_e^T (float32) for every real row of a live tile.

    act_PF fp8 with acts_PGf; w2 [E, D, F] fp8 with w2s [E, ceil(D / SCALE_BLOCK_N), Gf]; F % BLOCK_K == 0."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_tiles_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    num_padded, rows, e = tile_rows(pid_m, sorted_ptr, expert_ptr, num_padded_ptr, num_rows, 0, E,
                                    BLOCK_M, False, 16, 16)
    if pid_m * BLOCK_M >= num_padded:
        return
    is_row = rows < num_rows
    e = e.to(tl.int64)
    offs_p = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    is_n = offs_n < D
    a_ptrs = act_ptr + offs_p[:, None] * stride_ap + offs_k[None, :]
    w_ptrs = w2_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    as_ptrs = acts_ptr + offs_p * stride_asp
    ws_ptrs = w2s_ptr + e * stride_wse + (offs_n // SCALE_BLOCK_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, F // BLOCK_K):
        a = tl.load(a_ptrs)
        w = tl.load(w_ptrs, mask=is_n[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb)
        w_s = tl.load(ws_ptrs + kb, mask=is_n, other=0.0)
        a, w = dot_operands(a, w, DOT_UPCAST)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    weight = tl.load(weights_ptr + rows, mask=is_row, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_yn + offs_n[None, :]
    tl.store(y_ptrs, acc * weight[:, None], mask=is_row[:, None] & is_n[None, :])
