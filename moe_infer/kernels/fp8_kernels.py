"""Raw Triton kernels of block-scaled FP8 (W8A8): per-token-group activation quantization and the
dense GEMM with 128x128-style weight block scales (launch wrappers: fp8_gemm.py; references: fp8_ref.py).

Quantization (one program: one token, BLOCK_G groups of GROUP values):
    scale[t, g] = max(max |x|, SCALE_EPS) / FP8_MAX,  x_fp8 = e4m3(clamp(x / scale, +-FP8_MAX))
with IEEE division (tl.div_rn) and round-to-nearest-even, as torch does, so the bits match the reference.
EXACT_RNE (the CPU interpreter only): the interpreter's float32 -> e4m3 cast rounds ties up and loses the
carry into the exponent (31.9 -> 16), so `round_e4m3` rounds in float32 first and the cast is then exact.

GEMM (one program: a BLOCK_M x BLOCK_N tile of y over K blocks [split * k / SPLIT_K, (split + 1) * k / SPLIT_K);
BLOCK_K = the scale group, so one x scale per row and one w scale per column a K step):
acc += dot(x_fp8, w_fp8^T) * x_scale[:, None] * w_scale[None, :], the dot float32-accumulated on fp8 tensor
cores (sm_89+). DOT_UPCAST 0: fp8 operands; 1: bfloat16 (exact
for e4m3 values; a GPU whose fp8 dot needs a K tile over BLOCK_K); 2: float32 (the interpreter, whose
fp8/bf16 dot is wrong). SPLIT_K > 1 (few tokens: more programs than output tiles to stream the weight): each split
writes its float32 partial tile to y[split] of a [SPLIT_K, T, N] buffer, which the wrapper sums in a fixed order
(no atomics: the result does not depend on the order programs finish); split_sum_kernel sums them in one launch.
QUANT_A (few tokens): x is read in its own dtype and quantized per row and K block in the prologue, bit for bit as
per_token_group_quant_kernel (each column tile's programs quantize the same rows again: at <= 16 rows that is
L2 reads of x, cheaper than a launch of its own).

Legend: T tokens, K reduction dim, N output columns, G groups (K / GROUP), k = K / BLOCK_K blocks.
"""
import triton
import triton.language as tl


@triton.jit
def round_e4m3(y):
    """y (float32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, still float32: normals keep
    3 mantissa bits (integer rounding on the bits carries into the exponent), subnormals (< 2^-6) are
    multiples of 2^-9 (the 1.5 * 2^23 trick rounds to an integer, ties to even)."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = ((y * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def quant_e4m3(y, scale, FP8_MAX: tl.constexpr, EXACT_RNE: tl.constexpr):
    """e4m3 (float8e4nv) of clamp(y / scale, +-FP8_MAX); scale broadcasts against y."""
    q = tl.clamp(tl.div_rn(y, scale), -FP8_MAX, FP8_MAX)
    if EXACT_RNE:
        q = round_e4m3(q)
    return q.to(tl.float8e4nv)


@triton.jit
def group_scale(amax, FP8_MAX: tl.constexpr, SCALE_EPS: tl.constexpr):
    """The scale of a group from its max |value|: max(amax, SCALE_EPS) / FP8_MAX (IEEE division)."""
    return tl.div_rn(tl.maximum(amax, SCALE_EPS), FP8_MAX)


@triton.jit(do_not_specialize=["T"])
def per_token_group_quant_kernel(x_ptr, q_ptr, s_ptr, T, G, stride_xt, stride_qt, stride_st,
                                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_G: tl.constexpr,
                                 FP8_MAX: tl.constexpr, SCALE_EPS: tl.constexpr, EXACT_RNE: tl.constexpr):
    """q_TK[t], s_TG[t] for groups [pid_g * BLOCK_G, +BLOCK_G) of token t (GROUP_PAD: GROUP's power of two)."""
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, GROUP_PAD)
    mask = (offs_g < G)[:, None] & (offs_c < GROUP)[None, :]
    cols = offs_g[:, None] * GROUP + offs_c[None, :]
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    scale = group_scale(tl.max(tl.abs(x), axis=1), FP8_MAX, SCALE_EPS)
    tl.store(q_ptr + t * stride_qt + cols, quant_e4m3(x, scale[:, None], FP8_MAX, EXACT_RNE), mask=mask)
    tl.store(s_ptr + t * stride_st + offs_g, scale, mask=offs_g < G)


@triton.jit
def dot_operands(a, b, DOT_UPCAST: tl.constexpr):
    """a, b as tl.dot takes them: fp8 as loaded (0), or upcast to bfloat16 (1) or float32 (2)."""
    if DOT_UPCAST == 1:
        a = a.to(tl.bfloat16)
        b = b.to(tl.bfloat16)
    elif DOT_UPCAST == 2:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def grouped_tile(pid, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile pid: groups of GROUP_M row tiles, column-major inside a group (L2 reuse)."""
    group = GROUP_M * num_tiles_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_tiles_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit(do_not_specialize=["T"])
def w8a8_block_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, T, N, K,
                           stride_xt, stride_xst, stride_wn, stride_wsn, stride_yt,
                           SCALE_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_UPCAST: tl.constexpr,
                           SPLIT_K: tl.constexpr, QUANT_A: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
                           SCALE_EPS: tl.constexpr = 1e-10, EXACT_RNE: tl.constexpr = False):
    """y_TN = sum_kb dot(x_fp8[:, kb], w_fp8[:, kb]^T) * xs_Tk[:, kb] * ws_nk[n // SCALE_BLOCK_N, kb]; the K blocks
    of split program_id(1) of SPLIT_K, written at y_ptr + split * T * stride_yt.

    K % BLOCK_K == 0 (the wrapper checks); unit strides along K; ws_nk's column stride is 1."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(T, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    num_kb = K // BLOCK_K
    kb_start = split * num_kb // SPLIT_K
    kb_end = (split + 1) * num_kb // SPLIT_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    is_m = offs_m < T
    is_n = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt + kb_start * BLOCK_K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + kb_start * BLOCK_K + offs_k[:, None]
    xs_ptrs = xs_ptr + offs_m.to(tl.int64) * stride_xst
    ws_ptrs = ws_ptr + (offs_n // SCALE_BLOCK_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        if QUANT_A:  # x in its own dtype: this block's group scale and fp8 values, as the quantization kernel's
            x = tl.load(x_ptrs, mask=is_m[:, None], other=0.0).to(tl.float32)
            a_s = group_scale(tl.max(tl.abs(x), axis=1), FP8_MAX, SCALE_EPS)
            a = quant_e4m3(x, a_s[:, None], FP8_MAX, EXACT_RNE)
        else:
            a = tl.load(x_ptrs, mask=is_m[:, None], other=0.0)
            a_s = tl.load(xs_ptrs + kb, mask=is_m, other=0.0)
        b = tl.load(w_ptrs, mask=is_n[None, :], other=0.0)
        b_s = tl.load(ws_ptrs + kb, mask=is_n, other=0.0)
        a, b = dot_operands(a, b, DOT_UPCAST)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + (split * T + offs_m.to(tl.int64))[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=is_m[:, None] & is_n[None, :])


@triton.jit
def split_sum_kernel(y_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over s in order of y[s * numel + i] (float32 partials of a split GEMM), cast to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(y_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(y_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
