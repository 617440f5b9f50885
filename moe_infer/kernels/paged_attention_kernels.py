"""Raw Triton kernels of paged attention that read K/V in place through the block tables
(launch wrappers and checks: `moe_infer.kernels.paged_attention`; PyTorch reference:
`moe_infer.layers.paged_attention.paged_attention_ref`).

One program attends BLOCK_Q query tokens of one sequence for the G = H / Hkv query heads that share
one KV head: its BLOCK_M rows are (token, head-in-group) pairs, so a decode step (one token) still
fills a tile with the G heads and every K/V tile is loaded once per KV head, not once per query
head (GQA). Keys are visited in tiles of BLOCK_N; the page of each key comes from the block table,
so no contiguous copy of the context is ever made. Causal by position: the step's q_len tokens of a
sequence are its last q_len positions, key j is visible to the query at position p iff j <= p (and
p - j < WINDOW with a sliding window). Online softmax in float32; float32 inputs multiply in IEEE
float32 (DOT_PRECISION), not TF32, so a float32 model keeps its reference accuracy.

Whole key tiles below a query tile's first position run without masks; exp2 with the scale folded
in (log2 units for the row maxima).

Program order: blocks are dispatched in program-id order. Under the causal mask a sequence's last
query tiles see the most keys; when a prefill has only a few waves of programs (one long prompt),
HEAVY_FIRST numbers them so those tiles start first, every (sequence, KV head) of one tile index side
by side, and the short tiles fill in behind them instead of trailing them (one 1024-token prompt of
Qwen3-30B-A3B's heads on an H100: 49.6 -> 34.4 us). Many waves (a batch of prompts) keep the plain
order, which measured faster there (16 x 1024: 536 vs 603 us).

Attention sinks (GPT-OSS, HAS_SINKS): each query head's learned logit joins the softmax's denominator; the
kernels add exp(sink) when they normalise (`_store_rows`, or the split merge), rescaled by the running maximum.
A sliding window (HAS_WINDOW) starts the key loop at the window's first tile: blocks wholly before the window are
never read (the block table still holds them; see docs/models.md on the memory).

Split-KV (decode of long contexts): with NUM_SPLITS > 1 the program of split s handles keys
[s * SPLIT_N, (s + 1) * SPLIT_N) and writes its unnormalised partial output, row max and row sum to
a float32 workspace; `paged_attention_reduce_kernel` merges the splits.

Both kernels are launched with programmatic dependent launch where the device has it (`pdl.py`): the
kernel after them (the attention output projection, `skinny_gemm`, at one token) is placed on the SMs
early and reads its weights while they run.

Legend: T query tokens of the step, B sequences, M max blocks per sequence, H query heads,
Hkv KV heads, G = H / Hkv, d head_dim, Nb cache blocks, S block size (PAGE).
"""
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter


@triton.jit(do_not_specialize=["stride_bt", "stride_ps", "stride_ms"])
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, m_part_ptr, l_part_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, sinks_ptr,
    scale, window, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt,
    SPLIT_N,
    G: tl.constexpr, HKV: tl.constexpr, HEAD_D: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HEAVY_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, HAS_SINKS: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
):
    if HEAVY_FIRST:  # grid (B * Hkv, query tiles * NUM_SPLITS): see the module docstring
        b = tl.program_id(0) // HKV
        kv_head = tl.program_id(0) % HKV
        q_tile = tl.num_programs(1) // NUM_SPLITS - 1 - tl.program_id(1) // NUM_SPLITS
    else:  # grid (B, query tiles * NUM_SPLITS, Hkv)
        b = tl.program_id(0)
        kv_head = tl.program_id(2)
        q_tile = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    # the step's query starts and lengths come from the step's inputs, not from the kernel before: read before waiting
    pdl_enter(USE_PDL)
    context = seq_len - q_len  # keys before the step's first query token

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // G
    head = kv_head * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (tok < q_len)
    offs_d = tl.arange(0, HEAD_D)
    d_ok = offs_d < D
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    pos = context + tok  # position of each query row

    kv_end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)  # no key past the tile's last query
    if KV_FP8:  # e4m3 K/V with a scale per KV head: k's in the score scale, v's on the output
        scale = scale * tl.load(k_scale_ptr + kv_head)
    acc, m_i, l_i = _attend_keys(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr, b, kv_head, context + q_tile * BLOCK_Q, kv_end, split, pos,
        window, scale, offs_d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        SPLIT_N, PAGE, BLOCK_M, BLOCK_N, HEAD_D, NUM_SPLITS, HAS_WINDOW, DOT_FP32, DOT_PRECISION)
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    _store_rows(acc, m_i, l_i, out_ptr, part_ptr, m_part_ptr, l_part_ptr, q_start + tok, head, row_ok, split, offs_d,
                d_ok, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, NUM_SPLITS,
                sinks_ptr, HAS_SINKS)


@triton.jit
def _attend_keys(
    q, k_cache_ptr, v_cache_ptr, block_tables_ptr, b, kv_head, first_pos, kv_end, split, pos, window, scale,
    offs_d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, SPLIT_N,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The online softmax of the q rows [BLOCK_M, HEAD_D] (positions pos, the first first_pos) over keys
    [0, kv_end) of sequence b's KV head (the window's and the split's part of them) -> (acc, m_i, l_i)."""
    kv_start = first_pos * 0
    if HAS_WINDOW:
        kv_start = tl.maximum(first_pos - window + 1, 0)
        kv_start = (kv_start // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:
        kv_start = tl.maximum(kv_start, split * SPLIT_N)
        kv_end = tl.minimum(kv_end, (split + 1) * SPLIT_N)

    # keys up to the tile's first query position are visible to every row: those whole BLOCK_N tiles run
    # without masks (no window); the rest (the diagonal, a split's or a window's edge) masked
    full_end = kv_start
    if not HAS_WINDOW:
        full_end = tl.maximum(tl.minimum(kv_end, ((first_pos + 1) // BLOCK_N) * BLOCK_N), kv_start)
    qk_scale = scale * 1.4426950408889634  # exp2 domain: m_i and the split maxima are in log2 units
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    for n0 in range(kv_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, block_tables_ptr, b, kv_head, n0, full_end, pos, window, qk_scale,
            acc, m_i, l_i, offs_d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
            PAGE, BLOCK_N, False, HAS_WINDOW, DOT_FP32, DOT_PRECISION)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, block_tables_ptr, b, kv_head, n0, kv_end, pos, window, qk_scale,
            acc, m_i, l_i, offs_d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
            PAGE, BLOCK_N, True, HAS_WINDOW, DOT_FP32, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _store_rows(
    acc, m_i, l_i, out_ptr, part_ptr, m_part_ptr, l_part_ptr, t, head, row_ok, split, offs_d, d_ok,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, NUM_SPLITS: tl.constexpr,
    sinks_ptr, HAS_SINKS: tl.constexpr,
):
    """The rows' output (tokens t, heads head) normalised into out, or with NUM_SPLITS > 1 their partial sums,
    row maxima and row sums into the split's workspace (the merge adds the sinks then). HAS_SINKS: each head's sink
    logit joins the softmax's denominator (exp(sink), no value)."""
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_all = tl.maximum(m_i, sink)  # log2 units, as m_i
            alpha = tl.exp2(m_i - m_all)  # 0 for a row that saw no key
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_all)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(part_ptr + split * stride_ps + t[:, None] * stride_pt + head[:, None] * stride_ph + offs_d[None, :],
                 acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(m_part_ptr + split * stride_ms + t * stride_mt + head, m_i, mask=row_ok)
        tl.store(l_part_ptr + split * stride_ms + t * stride_mt + head, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["stride_ps", "stride_ms"])
def paged_attention_reduce_kernel(
    part_ptr, m_part_ptr, l_part_ptr, out_ptr,
    stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_D: tl.constexpr, D: tl.constexpr, USE_PDL: tl.constexpr,
    sinks_ptr=None, HAS_SINKS: tl.constexpr = False,
):
    """out[t, h] = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s over the splits (m = max_s m_s, log2 units);
    HAS_SINKS: 2^(sink - m) more in the denominator (m then the max of the m_s and the sink)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    m_s = tl.load(m_part_ptr + offs_s * stride_ms + t * stride_mt + h)
    l_s = tl.load(l_part_ptr + offs_s * stride_ms + t * stride_mt + h)
    m = tl.max(m_s, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_s = tl.exp2(m_s - m)  # 0 for a split that saw no key (m_s = -inf)
    offs_d = tl.arange(0, HEAD_D)
    d_ok = offs_d < D
    acc = tl.load(part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
                  mask=d_ok[None, :], other=0.0)
    num = tl.sum(acc * w_s[:, None], 0)
    den = tl.sum(l_s * w_s, 0)
    if HAS_SINKS:
        den += tl.exp2(sink - m)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _attend_tile(
    q, k_cache_ptr, v_cache_ptr, block_tables_ptr, b, kv_head, n0, kv_end, pos, window, qk_scale,
    acc, m_i, l_i, offs_d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N tile of keys [n0, n0 + BLOCK_N) into the online softmax (exp2; MASKED: keys past kv_end,
    the causal diagonal and the window are masked; unmasked tiles are wholly visible to every row)."""
    keys = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        key_ok = keys < kv_end
        page = tl.load(block_tables_ptr + b * stride_bt + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        kv_mask = key_ok[:, None] & d_ok[None, :]
    else:
        page = tl.load(block_tables_ptr + b * stride_bt + keys // PAGE).to(tl.int64)
        kv_mask = d_ok[None, :]
    slot = keys % PAGE
    k = tl.load(k_cache_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                + offs_d[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:  # an fp8 cache: its values in q's dtype (exact); a no-op for a 16-bit cache
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[:, None] - keys[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
