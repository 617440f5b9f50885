"""Raw Triton kernel of MLA attention in the weight-absorbed form, reading the latent cache in place through the
block tables (launch wrapper and checks: `moe_infer.kernels.mla_attention`; PyTorch reference:
`moe_infer.layers.mla.mla_attend_torch`).

Every query head attends over the same cached rows (multi-query attention): a row is [c_kv | k_rot], C_LAT + C_ROPE
values, the key; its first C_LAT values are the value. One program takes BLOCK_Q query tokens of one sequence for
BLOCK_H heads: its BLOCK_Q * BLOCK_H rows are (token, head) pairs, so a decode step (one token) fills a tile with
BLOCK_H heads and every key tile is loaded once for all of them. The value accumulator may be split over V_PARTS
programs (each BLOCK_V of the C_LAT values; the scores are computed by each): more heads a program with the same
registers. Scores are the latent product plus the rotary
product (two dots: the row is not a power of two wide); the value accumulator is [rows, C_LAT] in float32. Causal
by position as the paged MHA kernel (`paged_attention_kernels`): the step's q_len tokens of a sequence are its last
q_len positions. Online softmax in exp2 units. Split-KV for decodes of few programs: split s takes keys
[s * SPLIT_N, (s + 1) * SPLIT_N) into a float32 workspace, merged by `paged_attention_reduce_kernel`.
KV_FP8: an e4m3 cache holding row / kv_scale (one float32 scale, the latent "head"'s): its values are read in q's
dtype (exact), the scale folded into the score scale (keys) and the accumulator (values) as the paged MHA kernel does.

Legend: T query tokens, B sequences, H heads, C_LAT latent width (kv_lora_rank), C_ROPE rotary width, Nb blocks,
S block size (PAGE).
"""
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter


@triton.jit(do_not_specialize=["stride_bt", "stride_ps", "stride_ms"])
def mla_attention_kernel(
    q_ptr, cache_ptr, out_ptr, part_ptr, m_part_ptr, l_part_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, scale, kv_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs,
    stride_bt, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt,
    SPLIT_N,
    H: tl.constexpr, C_LAT: tl.constexpr, C_ROPE: tl.constexpr, LAT_P: tl.constexpr, ROPE_P: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr, V_PARTS: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    b = tl.program_id(0)
    q_tile = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    head_group = tl.program_id(2) // V_PARTS
    v_part = tl.program_id(2) % V_PARTS
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    pdl_enter(USE_PDL)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = q_tile * BLOCK_Q + rows // BLOCK_H
    head = head_group * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_len) & (head < H)
    offs_c = tl.arange(0, LAT_P)
    offs_r = tl.arange(0, ROPE_P)
    c_ok = offs_c < C_LAT
    r_ok = offs_r < C_ROPE
    offs_v = v_part * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's value columns
    v_ok = offs_v < C_LAT
    q_row = q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_rot = tl.load(q_row + C_LAT + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_rot = q_rot.to(tl.float32)
    pos = context + tok

    kv_start = context * 0
    kv_end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)  # no key past the tile's last query
    if NUM_SPLITS > 1:
        kv_start = split * SPLIT_N
        kv_end = tl.minimum(kv_end, (split + 1) * SPLIT_N)
    if KV_FP8:
        kv_scale = tl.load(kv_scale_ptr)
        scale = scale * kv_scale
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_V], dtype=tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        page = tl.load(block_tables_ptr + b * stride_bt + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        row_base = cache_ptr + page[:, None] * stride_cb + (keys % PAGE)[:, None] * stride_cs
        k_lat = tl.load(row_base + offs_c[None, :], mask=key_ok[:, None] & c_ok[None, :], other=0.0)
        k_rot = tl.load(row_base + C_LAT + offs_r[None, :], mask=key_ok[:, None] & r_ok[None, :], other=0.0)
        if DOT_FP32:
            k_lat = k_lat.to(tl.float32)
            k_rot = k_rot.to(tl.float32)
        else:  # an fp8 cache: its values in q's dtype (exact); a no-op for a 16-bit cache
            k_lat = k_lat.to(q_lat.dtype)
            k_rot = k_rot.to(q_rot.dtype)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
        s += tl.dot(q_rot, tl.trans(k_rot), input_precision=DOT_PRECISION)
        s = s * qk_scale
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_PARTS == 1:
            v = k_lat
        else:  # this program's columns of the value (the rows' latent part), from L1 / L2 after the key load
            v = tl.load(row_base + offs_v[None, :], mask=key_ok[:, None] & v_ok[None, :], other=0.0)
            v = v.to(tl.float32) if DOT_FP32 else v.to(q_lat.dtype)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if KV_FP8:
        acc = acc * kv_scale
    t = q_start + tok
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_v[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
    else:
        tl.store(part_ptr + split * stride_ps + t[:, None] * stride_pt + head[:, None] * stride_ph + offs_v[None, :],
                 acc, mask=row_ok[:, None] & v_ok[None, :])
        if v_part == 0:
            tl.store(m_part_ptr + split * stride_ms + t * stride_mt + head, m_i, mask=row_ok)
            tl.store(l_part_ptr + split * stride_ms + t * stride_mt + head, l_i, mask=row_ok)
