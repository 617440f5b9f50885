"""Raw Triton kernels of the experts at one token: SwiGLU experts as matrix-vector products, the top-k
combine inside the down kernel.

At one token every routed row has its own expert, so a tile GEMM pads each row to 16 (tl.dot) and an
expert's weights are streamed by few programs. Here the weights are streamed by many narrow programs
(as in skinny_gemm_kernels.py), multiplied in float32 without tensor cores:

    gate_up_gemv_kernel  grid (N, cdiv(F, BLOCK_F)): act_NF[n, f-block] = silu(x @ w1.T) * (x @ w3.T)
                         of row n's expert, rounded once to act's dtype (as gate_up_kernel)
    down_gemv_kernel     grid (T, cdiv(D, BLOCK_D)): out_TD[t, d-block] = sum over t's local rows n of
                         round(weight_n * act_NF[n] @ w2_e[d-block].T), summed in float32 and rounded once
                         (the rounding steps of down_kernel + combine_kernel; the sum's order differs)

Rows of experts that are not local (another rank's, or dropped: id -1) are skipped; a token without a
local row gets zeros. The down kernel reads its rows' expert ids and first weight tiles before waiting on
the gate_up kernel (`pdl_enter`): the ids are the routing gate's, two kernels back, visible once every
gate_up program has passed its own wait, which is when PDL lets the down kernel start. So the down
weights stream while the gate_up kernel drains.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k, N = T*K routed rows.
Launch wrapper and references: `moe_infer.kernels.expert_gemv`.
"""
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter


@triton.jit
def _local_expert(ids_ptr, n, expert_start, E):
    """(local expert of routed row n as int64, whether it is local)."""
    raw = tl.load(ids_ptr + n, cache_modifier=".cg").to(tl.int32)
    key = raw - expert_start
    return key.to(tl.int64), (raw >= 0) & (key >= 0) & (key < E)


@triton.jit
def gate_up_gemv_kernel(x_ptr, w13_ptr, ids_ptr, act_ptr, ROW_DIV, D, F, expert_start, E,
                        stride_xm, stride_we, stride_wn, stride_am,
                        BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    n = tl.program_id(0)
    pid_f = tl.program_id(1)
    pdl_enter(USE_PDL)  # the ids are the kernel before's output
    e, is_local = _local_expert(ids_ptr, n, expert_start, E)
    if is_local:
        offs_F = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        offs_K = tl.arange(0, BLOCK_K)
        is_F = offs_F < F
        g_ptrs = w13_ptr + e * stride_we + offs_F.to(tl.int64)[:, None] * stride_wn + offs_K[None, :]
        u_ptrs = g_ptrs + F * stride_wn
        x_row = x_ptr + (n // ROW_DIV).to(tl.int64) * stride_xm
        acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
        for k in range(0, D, BLOCK_K):
            is_K = k + offs_K < D
            mask = is_F[:, None] & is_K[None, :]
            g = tl.load(g_ptrs + k, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(u_ptrs + k, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_row + k + offs_K, mask=is_K, other=0.0).to(tl.float32)
            acc_g += tl.sum(g * x[None, :], axis=1)
            acc_u += tl.sum(u * x[None, :], axis=1)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(act_ptr + n.to(tl.int64) * stride_am + offs_F, act.to(act_ptr.dtype.element_ty), mask=is_F)


@triton.jit
def down_gemv_kernel(act_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, D, F, expert_start, E,
                     stride_am, stride_we, stride_wn, stride_ot,
                     TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """All of token t's K rows at once: one [K, BLOCK_D, BLOCK_F] load of their experts' tiles (every load of a
    program in flight together), non-local rows masked to zero (adding 0.0 is skipping them)."""
    t = tl.program_id(0)
    offs_D = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_F = tl.arange(0, BLOCK_F)
    kk = tl.arange(0, K_PAD)
    is_D = offs_D < D
    rows_K = t * TOP_K + kk
    # before the wait: the rows' experts (the routing gate's ids, see the module docstring) and their first tiles
    raw_K = tl.load(ids_ptr + rows_K, mask=kk < TOP_K, other=-1, cache_modifier=".cg").to(tl.int32)
    key_K = raw_K - expert_start
    num_f_K = tl.where((raw_K >= 0) & (key_K >= 0) & (key_K < E), F, 0)  # no columns for a row that is not local
    w_ptrs = (w2_ptr + key_K.to(tl.int64)[:, None, None] * stride_we
              + offs_D.to(tl.int64)[None, :, None] * stride_wn + offs_F[None, None, :])
    w_KDF = tl.load(w_ptrs, mask=is_D[None, :, None] & (offs_F[None, None, :] < num_f_K[:, None, None]), other=0.0)
    pdl_enter(USE_PDL)
    a_ptrs = act_ptr + rows_K.to(tl.int64)[:, None] * stride_am + offs_F[None, :]
    a_KF = tl.load(a_ptrs, mask=offs_F[None, :] < num_f_K[:, None], other=0.0).to(tl.float32)
    acc_KD = tl.sum(w_KDF.to(tl.float32) * a_KF[:, None, :], axis=2)
    for f in range(BLOCK_F, F, BLOCK_F):
        w_KDF = tl.load(w_ptrs + f, mask=is_D[None, :, None] & (f + offs_F[None, None, :] < num_f_K[:, None, None]),
                        other=0.0)
        a_KF = tl.load(a_ptrs + f, mask=f + offs_F[None, :] < num_f_K[:, None], other=0.0).to(tl.float32)
        acc_KD += tl.sum(w_KDF.to(tl.float32) * a_KF[:, None, :], axis=2)
    weight_K = tl.load(weights_ptr + rows_K, mask=num_f_K > 0, other=0.0).to(tl.float32)
    y_KD = (acc_KD * weight_K[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_D, tl.sum(y_KD, axis=0).to(out_ptr.dtype.element_ty), mask=is_D)
