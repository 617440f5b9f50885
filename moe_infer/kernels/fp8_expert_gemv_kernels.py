"""Raw Triton kernels of the block-scaled FP8 (W8A8) experts at one token: matrix-vector products in float32 on
CUDA cores, as `expert_gemv_kernels.py` does for bf16 (wrapper: fp8_expert_gemv.py; reference:
fp8_ref.fused_moe_fp8_ref).

At one token the K routed rows each have their own expert: the tile kernels of fused_moe_fp8_kernels.py pad every
row to a 16-row tile, and gate_up's column tile must be a whole scale group (the epilogue quantizes the
intermediate), so a step has num_rows x F / 128 programs (48 for Qwen3-30B-A3B at one token, on 132 SMs), each
streaming 2 x 128 x D weight bytes alone. Here many narrow programs stream the weights, and the activation
quantizations move into the prologues (no launch of their own):

    gate_up_fp8_gemv_kernel  grid (N, cdiv(F, BLOCK_F)): x[row // ROW_DIV] quantized per group of GROUP in the
                             program (the bits of per_token_group_quant_kernel), then for each group
                             partial = sum(x_fp8 * w_fp8) * x_scale * w_scale, float32; act_NF = silu(g) * u, float32
    down_fp8_gemv_kernel     grid (T, cdiv(D, BLOCK_D)): all K rows of token t; each row's act quantized per group
                             (as gate_up_fp8_kernel's epilogue does), dotted with its expert's w2 columns, times
                             the routing weight, summed over the rows in float32, one cast (the combine)

fp8 values and the products are exact in float32; the sums differ from the reference only by order. Rows whose id is
outside [0, E) (dropped: -1) are skipped; a token without a row gets zeros.

Legend: T tokens, D hidden, F expert intermediate, E experts, K top-k, N = T*K routed rows, G groups of GROUP.
"""
import triton
import triton.language as tl

from moe_infer.kernels.fp8_kernels import group_scale, quant_e4m3
from moe_infer.kernels.pdl import pdl_enter


@triton.jit
def gate_up_fp8_gemv_kernel(x_ptr, w13_ptr, w13s_ptr, ids_ptr, act_ptr, ROW_DIV, D, F, E,
                            stride_xt, stride_we, stride_wn, stride_wse, stride_wsn, stride_an,
                            SCALE_BLOCK_N: tl.constexpr, GROUP: tl.constexpr, BLOCK_F: tl.constexpr,
                            BLOCK_G: tl.constexpr, FP8_MAX: tl.constexpr, SCALE_EPS: tl.constexpr,
                            EXACT_RNE: tl.constexpr, USE_PDL: tl.constexpr):
    """act_NF[n, f-block] = silu(g) * u (float32), g, u = W8A8 x[n // ROW_DIV] @ w1_e^T, w3_e^T; e = ids[n]."""
    n = tl.program_id(0)
    pid_f = tl.program_id(1)
    pdl_enter(USE_PDL)  # the ids and x are the kernels' before
    raw = tl.load(ids_ptr + n).to(tl.int32)
    if (raw >= 0) & (raw < E):
        e = raw.to(tl.int64)
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        offs_g = tl.arange(0, BLOCK_G)
        offs_c = tl.arange(0, GROUP)
        is_f = offs_f < F
        x_row = x_ptr + (n // ROW_DIV).to(tl.int64) * stride_xt
        w_rows = w13_ptr + e * stride_we + offs_f.to(tl.int64)[:, None, None] * stride_wn  # [BLOCK_F, 1, 1]
        gs_rows = w13s_ptr + e * stride_wse + (offs_f // SCALE_BLOCK_N)[:, None] * stride_wsn
        us_rows = w13s_ptr + e * stride_wse + ((offs_f + F) // SCALE_BLOCK_N)[:, None] * stride_wsn
        acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
        num_groups = D // GROUP
        for g0 in range(0, num_groups, BLOCK_G):
            gs = g0 + offs_g
            is_g = gs < num_groups
            cols = gs[:, None] * GROUP + offs_c[None, :]  # [BLOCK_G, GROUP]
            x = tl.load(x_row + cols, mask=is_g[:, None], other=0.0).to(tl.float32)
            x_s = group_scale(tl.max(tl.abs(x), axis=1), FP8_MAX, SCALE_EPS)
            x_q = quant_e4m3(x, x_s[:, None], FP8_MAX, EXACT_RNE).to(tl.float32)
            mask = is_f[:, None, None] & is_g[None, :, None]
            w_g = tl.load(w_rows + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
            w_u = tl.load(w_rows + F * stride_wn + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
            s_mask = is_f[:, None] & is_g[None, :]
            s_g = tl.load(gs_rows + gs[None, :], mask=s_mask, other=0.0)
            s_u = tl.load(us_rows + gs[None, :], mask=s_mask, other=0.0)
            acc_g += tl.sum(tl.sum(w_g * x_q[None, :, :], axis=2) * x_s[None, :] * s_g, axis=1)
            acc_u += tl.sum(tl.sum(w_u * x_q[None, :, :], axis=2) * x_s[None, :] * s_u, axis=1)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(act_ptr + n.to(tl.int64) * stride_an + offs_f, act, mask=is_f)


@triton.jit
def down_fp8_gemv_kernel(act_ptr, w2_ptr, w2s_ptr, ids_ptr, weights_ptr, out_ptr, D, F, E,
                         stride_an, stride_we, stride_wn, stride_wse, stride_wsn, stride_ot,
                         SCALE_BLOCK_N: tl.constexpr, GROUP: tl.constexpr, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr,
                         SCALE_EPS: tl.constexpr, EXACT_RNE: tl.constexpr, USE_PDL: tl.constexpr):
    """out_TD[t, d-block] = sum_k weight[t, k] * W8A8 quant(act_NF[t * K + k]) @ w2_e^T, summed in float32, cast."""
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, GROUP)
    kk = tl.arange(0, K_PAD)
    is_d = offs_d < D
    rows = t * TOP_K + kk
    pdl_enter(USE_PDL)
    raw = tl.load(ids_ptr + rows, mask=kk < TOP_K, other=-1).to(tl.int32)
    is_k = (raw >= 0) & (raw < E)
    e = tl.where(is_k, raw, 0).to(tl.int64)
    w_rows = w2_ptr + e[:, None, None] * stride_we + offs_d.to(tl.int64)[None, :, None] * stride_wn  # [K, BD, 1]
    ws_rows = w2s_ptr + e[:, None] * stride_wse + (offs_d // SCALE_BLOCK_N)[None, :] * stride_wsn  # [K, BD]
    a_rows = act_ptr + rows.to(tl.int64)[:, None] * stride_an  # [K, 1]
    w_mask = is_k[:, None, None] & is_d[None, :, None]
    acc = tl.zeros([K_PAD, BLOCK_D], dtype=tl.float32)
    for g in range(0, F // GROUP):
        cols = g * GROUP + offs_c
        a = tl.load(a_rows + cols[None, :], mask=is_k[:, None], other=0.0)
        a_s = group_scale(tl.max(tl.abs(a), axis=1), FP8_MAX, SCALE_EPS)
        a_q = quant_e4m3(a, a_s[:, None], FP8_MAX, EXACT_RNE).to(tl.float32)
        w = tl.load(w_rows + cols[None, None, :], mask=w_mask, other=0.0).to(tl.float32)
        w_s = tl.load(ws_rows + g, mask=is_k[:, None] & is_d[None, :], other=0.0)
        acc += tl.sum(w * a_q[:, None, :], axis=2) * a_s[:, None] * w_s
    weight = tl.load(weights_ptr + rows, mask=is_k, other=0.0).to(tl.float32)
    out = tl.sum(acc * weight[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_d, out.to(out_ptr.dtype.element_ty), mask=is_d)
