"""Raw Triton kernel: y = x @ W^T (+ bias) for a few rows of x, the weight streamed once (decode GEMV).

Legend: M rows of x (tokens, M <= BLOCK_M <= 4), K in features, N out features.

A program owns BLOCK_N output columns and reads their [BLOCK_N, K] slice of W once, in BLOCK_K tiles
(one tile where K fits): many narrow programs, each with a whole row slice of loads in flight, is
what keeps HBM busy when there is almost no arithmetic. Each tile is multiplied with every row of x
in float32 (a broadcast multiply and a sum over K per row; no tensor cores: they would pad the rows
to 16), so M rows cost one weight read.

The first weight tile does not depend on the kernel before: it is loaded before `pdl_enter`, so
under programmatic dependent launch the weight stream starts while that kernel drains.

Launch wrapper and reference: `moe_infer.kernels.skinny_gemm`.
"""
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter


@triton.jit
def _rows_dot(acc_MN, w_NK, x_ptr, k, offs_K, is_K, offs_M, M, stride_xm, BLOCK_M: tl.constexpr):
    """acc_MN + each row of x (columns k + offs_K) . the tile w_NK, in float32: [BLOCK_M, BLOCK_N]."""
    w32_NK = w_NK.to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        is_row_K = (offs_K * 0 + m) < M  # a tensor: the interpreter rejects scalar-and-vector bool masks
        x_K = tl.load(x_ptr + m * stride_xm + k + offs_K, mask=is_K & is_row_K, other=0.0).to(tl.float32)
        s_N = tl.sum(w32_NK * x_K[None, :], axis=1)
        acc_MN = tl.where(offs_M[:, None] == m, acc_MN + s_N[None, :], acc_MN)
    return acc_MN


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_M = tl.arange(0, BLOCK_M)
    offs_N = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_K = tl.arange(0, BLOCK_K)
    is_N = offs_N < N
    w_ptrs = w_ptr + offs_N[:, None].to(tl.int64) * stride_wn + offs_K[None, :]
    # the weight does not depend on the kernel before: its first tile is read before waiting on it
    w_NK = tl.load(w_ptrs, mask=is_N[:, None] & (offs_K[None, :] < K), other=0.0)
    pdl_enter(USE_PDL)
    acc_MN = _rows_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), w_NK, x_ptr, 0, offs_K, offs_K < K, offs_M, M,
                       stride_xm, BLOCK_M)
    for k in range(BLOCK_K, K, BLOCK_K):
        is_K = k + offs_K < K
        w_NK = tl.load(w_ptrs + k, mask=is_N[:, None] & is_K[None, :], other=0.0)
        acc_MN = _rows_dot(acc_MN, w_NK, x_ptr, k, offs_K, is_K, offs_M, M, stride_xm, BLOCK_M)
    if HAS_BIAS:  # added in float32 before the one rounding, as cuBLAS's bias epilogue
        acc_MN += tl.load(b_ptr + offs_N, mask=is_N, other=0.0).to(tl.float32)[None, :]
    is_MN = (offs_M[:, None] < M) & is_N[None, :]
    tl.store(y_ptr + offs_M[:, None] * stride_ym + offs_N[None, :], acc_MN.to(y_ptr.dtype.element_ty), mask=is_MN)
