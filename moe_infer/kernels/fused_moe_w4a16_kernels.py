"""Raw Triton kernels of the W4A16 fused MoE (wrappers: fused_moe_w4a16.py; formats: w4_format.py; reference:
w4_ref.py): the gate_up GEMM with SiLU * up in its epilogue and the down GEMM with the routing weight, over 4-bit
expert weights dequantized in registers.

Both walk the block-padded schedule of the bf16 fused MoE (`tile_rows`: sorted_P / expert_B / num_padded, or the
inline decode schedule), in the grouped tile order of `tile_of`; tiles past num_padded exit at once (static grid,
CUDA-graph capturable). Per K step a program loads its activation tile as the bf16 path does and its weight tile
[BLOCK_K, BLOCK_N] as 4-bit codes (`load_w4`: the packed words or bytes and the group scales each loaded once as
tiles contiguous along K, unpacked in registers), dequantizes it to the activations' dtype and runs tl.dot
(float32 operands under the interpreter: IS_FP32_DOT): `w4_operands` in the down and dense GEMMs. gate_up keeps its
block inline: through the helper (one tile after the other) Triton 3.9's sm_90 PTX of gate_up changed (scalar bf16
scale multiplies in place of bf16x2, two more barriers), which no GPU has timed.
The epilogues take the expert biases and GPT-OSS's clamped SwiGLU (moe_epilogue.py: HAS_BIAS, CLAMPED, HAS_BIAS2).

FMT 0: int4, packed int32 [E, N, K / 8], scales [E, N, K / GROUP], zeros uint8 [E, N, K / GROUP] (HAS_ZERO; else 8).
FMT 1: mxfp4, packed uint8 [E, N, K / 2] (low nibble first), e8m0 scales uint8 [E, N, K / 32] (GROUP = 32); the
e2m1 value and the power-of-two scale are built from their bits (exact; a scale byte 0 reads as 0, not 2^-127).

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k, N = T*K routed rows, P padded slots.
"""
import triton
import triton.language as tl

from moe_infer.kernels.fused_moe_align import tile_rows
from moe_infer.kernels.fused_moe_gemm import tile_of
from moe_infer.kernels.moe_epilogue_kernels import down_epilogue, gate_up_epilogue


@triton.jit
def load_groups(ptr, e, offs_n, is_n, k0, K, stride_se, stride_sn, other, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """The per-group values (scales, zero points) of the tile's rows k0 .. k0 + BLOCK_K: [1, BLOCK_N] when one group
    covers the tile, else each group's [BLOCK_N] values loaded once and repeated over its GROUP rows."""
    col = e * stride_se + offs_n[None, :].to(tl.int64) * stride_sn
    if BLOCK_K <= GROUP:
        v = tl.load(ptr + col + k0 // GROUP, mask=is_n[None, :], other=other)
    else:
        NG: tl.constexpr = BLOCK_K // GROUP
        BN: tl.constexpr = offs_n.shape[0]
        g = k0 // GROUP + tl.arange(0, NG)
        v_GN = tl.load(ptr + col + g[:, None], mask=(g[:, None] < K // GROUP) & is_n[None, :], other=other)
        v = tl.reshape(tl.broadcast_to(v_GN[:, None, :], [NG, GROUP, BN]), [BLOCK_K, BN])
    return v


@triton.jit
def load_w4(w_ptr, s_ptr, z_ptr, e, offs_n, is_n, k0, offs_k, K, stride_we, stride_wn, stride_se, stride_sn,
            FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr):
    """Expert e's weight rows offs_n, columns k0 .. k0 + BLOCK_K, as a float32 tile [BLOCK_K, BLOCK_N] (w^T).

    Each packed word / byte and each group's scale is loaded once, as a tile contiguous along K (coalesced), and
    unpacked in registers: the codes [BLOCK_K / PER, PER, BLOCK_N] reshaped to [BLOCK_K, BLOCK_N] (k = PER * word +
    nibble, low nibble first)."""
    BLOCK_K: tl.constexpr = offs_k.shape[0]
    BN: tl.constexpr = offs_n.shape[0]
    PER: tl.constexpr = 8 if FMT == 0 else 2
    KW: tl.constexpr = BLOCK_K // PER
    kw = k0 // PER + tl.arange(0, KW)
    row = e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    word = tl.load(w_ptr + row + kw[:, None], mask=(kw[:, None] < K // PER) & is_n[None, :], other=0).to(tl.int32)
    nib = tl.arange(0, PER) * 4
    code = tl.reshape((word[:, None, :] >> nib[None, :, None]) & 0xF, [BLOCK_K, BN])
    if FMT == 0:
        scale = load_groups(s_ptr, e, offs_n, is_n, k0, K, stride_se, stride_sn, 0.0, BLOCK_K, GROUP).to(tl.float32)
        if HAS_ZERO:
            zero = load_groups(z_ptr, e, offs_n, is_n, k0, K, stride_se, stride_sn, 0, BLOCK_K, GROUP).to(tl.float32)
        else:
            zero = 8.0
        w = (code.to(tl.float32) - zero) * scale
    else:
        ex = (code >> 1) & 3
        m = code & 1
        # e2m1 -> float32 bits: exponent ex - 1 (biased ex + 126) and the mantissa bit at bit 22; ex 0: m * 0.5
        bits = tl.where(ex == 0, m * (126 << 23), ((ex + 126) << 23) | (m << 22)) | ((code >> 3) << 31)
        s_bits = load_groups(s_ptr, e, offs_n, is_n, k0, K, stride_se, stride_sn, 127, BLOCK_K, GROUP).to(tl.int32)
        w = bits.to(tl.float32, bitcast=True) * (s_bits << 23).to(tl.float32, bitcast=True)
    return w


@triton.jit
def w4_operands(a, w_ptr, s_ptr, z_ptr, e, offs_n, is_n, k0, offs_k, K, stride_we, stride_wn, stride_se, stride_sn,
                FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, IS_FP32_DOT: tl.constexpr):
    """(a, w) ready for tl.dot: the weight tile w^T[k0 + offs_k, offs_n] dequantized (`load_w4`) to a's dtype, or
    both in float32 under the interpreter. The kernels load every operand of a K step before their dots."""
    w = load_w4(w_ptr, s_ptr, z_ptr, e, offs_n, is_n, k0, offs_k, K, stride_we, stride_wn, stride_se, stride_sn,
                FMT, GROUP, HAS_ZERO)
    if IS_FP32_DOT:
        a = a.to(tl.float32)
    else:
        w = w.to(a.dtype)
    return a, w


@triton.jit
def gate_up_w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, act_ptr, sorted_ptr, expert_ptr, num_padded_ptr,
                      num_rows, ROW_DIV, D, F, num_tiles_m, expert_start, E,
                      stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
                      FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      IS_FP32_DOT: tl.constexpr, INLINE: tl.constexpr, N_PAD: tl.constexpr, E_PAD: tl.constexpr,
                      b13_ptr, stride_be, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, ALPHA: tl.constexpr,
                      LIMIT: tl.constexpr):
    """act_PF[p] = silu(x[row_p // ROW_DIV] @ w1_e.T) * (x[..] @ w3_e.T), w13_e = [w1; w3] [2F, D] in 4 bits (with
    the gate/up bias and the clamped SwiGLU where HAS_BIAS / CLAMPED)."""
    pid_m, pid_n = tile_of(tl.program_id(0), num_tiles_m, tl.cdiv(F, BLOCK_N), GROUP_M)
    num_padded, rows, e = tile_rows(pid_m, sorted_ptr, expert_ptr, num_padded_ptr, num_rows, expert_start, E,
                                    BLOCK_M, INLINE, N_PAD, E_PAD)
    if pid_m * BLOCK_M >= num_padded:
        return
    is_row = rows < num_rows
    e = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    is_n = offs_n < F
    a_ptrs = x_ptr + (rows // ROW_DIV).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=is_row[:, None] & (offs_k[None, :] < D - k0), other=0.0)
        # inline, not `w4_operands` twice: see the module docstring (the PTX changed through the helper)
        g = load_w4(w_ptr, s_ptr, z_ptr, e, offs_n, is_n, k0, offs_k, D, stride_we, stride_wn, stride_se,
                    stride_sn, FMT, GROUP, HAS_ZERO)
        u = load_w4(w_ptr, s_ptr, z_ptr, e, offs_n + F, is_n, k0, offs_k, D, stride_we, stride_wn, stride_se,
                    stride_sn, FMT, GROUP, HAS_ZERO)
        if IS_FP32_DOT:
            a = a.to(tl.float32)
        else:
            g = g.to(a.dtype)
            u = u.to(a.dtype)
        acc_g = tl.dot(a, g, acc_g)
        acc_u = tl.dot(a, u, acc_u)
    act = gate_up_epilogue(acc_g, acc_u, b13_ptr, e, offs_n, is_n, F, stride_be, HAS_BIAS, CLAMPED, ALPHA, LIMIT)
    out_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=is_n[None, :])


@triton.jit
def down_w4_kernel(act_ptr, w_ptr, s_ptr, z_ptr, y_ptr, weights_ptr, sorted_ptr, expert_ptr, num_padded_ptr,
                   num_rows, D, F, num_tiles_m, expert_start, E,
                   stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                   FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   IS_FP32_DOT: tl.constexpr, INLINE: tl.constexpr, N_PAD: tl.constexpr, E_PAD: tl.constexpr,
                   b2_ptr, stride_b2e, HAS_BIAS2: tl.constexpr):
    """y_ND[row_p] = weights_N[row_p] * (act_PF[p] @ w2_e.T (+ b2[e])) (w2_e [D, F] in 4 bits) for the real rows of a
    live tile."""
    pid_m, pid_n = tile_of(tl.program_id(0), num_tiles_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    num_padded, rows, e = tile_rows(pid_m, sorted_ptr, expert_ptr, num_padded_ptr, num_rows, expert_start, E,
                                    BLOCK_M, INLINE, N_PAD, E_PAD)
    if pid_m * BLOCK_M >= num_padded:
        return
    is_row = rows < num_rows
    e = e.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    is_n = offs_n < D
    a_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=offs_k[None, :] < F - k0, other=0.0)
        a, w = w4_operands(a, w_ptr, s_ptr, z_ptr, e, offs_n, is_n, k0, offs_k, F, stride_we, stride_wn, stride_se,
                           stride_sn, FMT, GROUP, HAS_ZERO, IS_FP32_DOT)
        acc = tl.dot(a, w, acc)
    acc = down_epilogue(acc, b2_ptr, e, offs_n, is_n, stride_b2e, HAS_BIAS2)
    weight = tl.load(weights_ptr + rows, mask=is_row, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=is_row[:, None] & is_n[None, :])


@triton.jit
def w4a16_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                      FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_FP32_DOT: tl.constexpr):
    """y_MN = x_MK @ w_NK^T for one 4-bit weight (a dense layer): `load_w4` with one "expert"."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    is_m, is_n = offs_m < M, offs_n < N
    a_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=is_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
        a, w = w4_operands(a, w_ptr, s_ptr, z_ptr, 0, offs_n, is_n, k0, offs_k, K, 0, stride_wn, 0, stride_sn, FMT,
                           GROUP, HAS_ZERO, IS_FP32_DOT)
        acc = tl.dot(a, w, acc)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=is_m[:, None] & is_n[None, :])
