"""A decode step's attention in one kernel: the q/k RMSNorm (per head, where the family has one), the rotary
embedding, the K/V cache write and the paged attention over the cache (plus the split merge of long contexts).
It replaces `rope_store_kv` + `paged_attention_triton` where every sequence of the step has one query token;
the rotated q never goes to memory. The references are the two kernels' PyTorch references in turn
(`moe_infer.layers.rotary.rope_store_kv_ref`, then `moe_infer.layers.paged_attention.paged_attention_ref`).

One program per (sequence b, key split, KV head), as the decode tiles of `paged_attention_kernel`: it loads the
G query heads of its KV head as two halves, norms and rotates them with `rope_kv`'s functions (so the q the
attention sees has the same bits as `rope_store_kv`'s output), and joins the halves into the [BLOCK_M, d] tile.
The program whose key range holds the new token's position (the last split with keys) also norms and rotates the
token's k of its KV head and writes k and v at the token's slot (slot < 0, a padding row: nothing), then passes a
barrier so that its own threads read the new key back from the cache. The other programs never read that key.

Covered: head_dim a power of two, q/k norm "none" or "head" (Qwen3); the caller keeps the two kernels for "proj"
norms (OLMoE: a norm over all H heads), other head sizes and steps with prefill chunks (`supports`). Attention
sinks (GPT-OSS) as in `paged_attention_kernel`.

Legend: T query tokens (= B sequences with one each, padding rows included), H query heads, Hkv KV heads,
G = H / Hkv, d head_dim, P table positions, M max blocks per sequence, Nb cache blocks, S block size.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from moe_infer.kernels.paged_attention import PDL_ENV, check_sinks, decode_tiles, sinks_args, split_workspace
from moe_infer.kernels.paged_attention_kernels import _attend_keys, _store_rows, paged_attention_reduce_kernel
from moe_infer.kernels.pdl import pdl_enter, use_pdl
from moe_infer.kernels.rope_kv import _TL_DTYPES, NORM_MODES, _check_norm, _load_halves, _rms_norm, _rotate, check_inputs

# "0": decode steps run rope_store_kv + paged_attention_triton (A/B runs; read when the model's layers are built)
ENV = "MOE_ROPE_DECODE_ATTENTION"


# positions and slots are views into the step's one input buffer, at offsets that vary (as rope_store_kv's): not
# specialized on alignment, or an eager step could compile a variant the start-up warm-up did not
@triton.jit(do_not_specialize=["positions_ptr", "slots_ptr", "stride_bt", "stride_ps", "stride_ms"])
def rope_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, slots_ptr, q_norm_ptr, k_norm_ptr, eps, num_positions,
    k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, m_part_ptr, l_part_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_ptr, sinks_ptr, scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cp, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh_c, stride_vb, stride_vs, stride_vh_c, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, SPLIT_N,
    G: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DTYPE: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = tl.program_id(2)
    t = tl.load(query_start_ptr + b)
    if tl.load(query_start_ptr + b + 1) - t < 1:  # a sequence without a token this step
        return
    seq_len = tl.load(seq_lens_ptr + b)
    pos_tok = tl.load(positions_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    half = tl.arange(0, HALF)
    cs_ok = (half * 0 + pos_tok >= 0) & (half * 0 + pos_tok < num_positions)
    c_1h = tl.load(cos_sin_ptr + pos_tok * stride_cp + half, mask=cs_ok, other=0.0).to(tl.float32)[None, :]
    s_1h = tl.load(cos_sin_ptr + pos_tok * stride_cp + HALF + half, mask=cs_ok, other=0.0).to(tl.float32)[None, :]
    # the step's inputs and the table: read before waiting on the qkv projection
    pdl_enter(USE_PDL)

    context = seq_len - 1  # keys before the token; the token is the last key
    # the new key and value: written by the program whose key range holds position `context`
    writer = slot >= 0
    if NUM_SPLITS > 1:
        writer = writer & (split == context // SPLIT_N)
    if writer:
        kv_rows = tl.arange(0, 2)  # one row (a 2-row tile, the second masked)
        kv_mask = (kv_rows < 1)[:, None] & (half[None, :] < HALF)
        k_off = t * stride_kt + (kv_head + kv_rows)[:, None] * stride_kh
        k1, k2 = _load_halves(k_ptr, k_off, half, kv_mask, HALF)
        if NORM != 0:
            k1, k2 = _rms_norm(k1, k2, k_norm_ptr, kv_rows, half, kv_mask, eps, NORM, 1, DTYPE, HALF)
        k1, k2 = _rotate(k1, k2, c_1h, s_1h, DTYPE)
        block, offset = slot // PAGE, slot % PAGE
        dst = (block * stride_kb + offset * stride_ks + (kv_head + kv_rows)[:, None] * stride_kh_c
               + half[None, :])
        tl.store(k_cache_ptr + dst, k1.to(DTYPE), mask=kv_mask)
        tl.store(k_cache_ptr + dst + HALF, k2.to(DTYPE), mask=kv_mask)
        v_src = v_ptr + t * stride_vt + (kv_head + kv_rows)[:, None] * stride_vh + half[None, :]
        v_dst = (v_cache_ptr + block * stride_vb + offset * stride_vs + (kv_head + kv_rows)[:, None] * stride_vh_c
                 + half[None, :])
        tl.store(v_dst, tl.load(v_src, mask=kv_mask), mask=kv_mask)
        tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)
    tl.debug_barrier()  # the program's stores above are visible to all its threads' loads below

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G
    head = kv_head * G + rows % G
    q_mask = row_ok[:, None] & (half[None, :] < HALF)
    q1, q2 = _load_halves(q_ptr, t * stride_qt + head[:, None] * stride_qh, half, q_mask, HALF)
    if NORM != 0:
        q1, q2 = _rms_norm(q1, q2, q_norm_ptr, head, half, q_mask, eps, NORM, G, DTYPE, HALF)
    q1, q2 = _rotate(q1, q2, c_1h, s_1h, DTYPE)
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_M, 2 * HALF))  # [q1 | q2] per row
    if DOT_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(DTYPE)
    offs_d = tl.arange(0, 2 * HALF)
    d_ok = offs_d < 2 * HALF
    pos = context + rows * 0
    acc, m_i, l_i = _attend_keys(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr, b, kv_head, context, seq_len, split, pos, window, scale,
        offs_d, d_ok, stride_kb, stride_ks, stride_kh_c, stride_vb, stride_vs, stride_vh_c, stride_bt, SPLIT_N,
        PAGE, BLOCK_M, BLOCK_N, 2 * HALF, NUM_SPLITS, HAS_WINDOW, DOT_FP32, DOT_PRECISION)
    _store_rows(acc, m_i, l_i, out_ptr, part_ptr, m_part_ptr, l_part_ptr, t + rows * 0, head, row_ok, split, offs_d,
                d_ok, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, NUM_SPLITS,
                sinks_ptr, HAS_SINKS)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def fits(head_dim: int, norm_mode: str) -> bool:
    """Heads the kernel covers: a power-of-two head_dim of at least 16, no q/k norm or a per-head one."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and norm_mode in ("none", "head")


def supports(head_dim: int, norm_mode: str, max_query_len: int) -> bool:
    """Whether a step takes the fused kernel: decode only (one query token a sequence) and heads it `fits`;
    unless turned off by MOE_ROPE_DECODE_ATTENTION=0."""
    return max_query_len <= 1 and fits(head_dim, norm_mode) and os.environ.get(ENV, "1") != "0"


def rope_decode_attention(
    q_THd: torch.Tensor, k_THd: torch.Tensor, v_THd: torch.Tensor, positions_T: torch.Tensor,
    cos_sin_Pd: torch.Tensor, k_cache_NbSHd: torch.Tensor, v_cache_NbSHd: torch.Tensor, slot_mapping_T: torch.Tensor,
    block_tables_BM: torch.Tensor, seq_lens_B: torch.Tensor, query_start_loc_B1: torch.Tensor, scale: float,
    max_seq_len: int, sliding_window: Optional[int] = None, *, q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 0.0, norm_mode: str = "none",
    sinks_H: Optional[torch.Tensor] = None, splits: Optional[int] = None, block_n: Optional[int] = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Unrotated q [T, H, d], k, v [T, Hkv, d] of a decode step (each sequence's one token at query_start_loc)
    -> attention output [T, H, d]; k and v are written into the caches at slot_mapping_T as `rope_store_kv`
    writes them. Arguments as `rope_store_kv`'s and `paged_attention_triton`'s (max_query_len is 1; sinks_H);
    splits, block_n, num_warps: force a split count, a key tile or a warp count (tests, trials)."""
    T, H, d = q_THd.shape
    Nb, S, Hkv, dk = k_cache_NbSHd.shape
    B = seq_lens_B.shape[0]
    _check(fits(d, norm_mode),
           f"rope_decode_attention needs a power-of-two head_dim >= 16 and norm_mode none or head, got d={d}, "
           f"norm_mode={norm_mode!r}")
    check_inputs("rope_decode_attention", q_THd, k_THd, v_THd, positions_T, cos_sin_Pd, k_cache_NbSHd,
                 v_cache_NbSHd, slot_mapping_T)
    _check(H % Hkv == 0, f"GQA needs H % Hkv == 0, got H={H}, Hkv={Hkv}")
    _check(query_start_loc_B1.shape == (B + 1,) and block_tables_BM.dim() == 2 and block_tables_BM.shape[0] == B,
           f"query_start_loc {tuple(query_start_loc_B1.shape)} must be [B+1] and block_tables "
           f"{tuple(block_tables_BM.shape)} [B, M], B = {B}")
    _check(block_tables_BM.stride(1) == 1, "block_tables needs a unit stride on M")
    for name, x in (("block_tables", block_tables_BM), ("seq_lens", seq_lens_B), ("query_start_loc", query_start_loc_B1)):
        _check(x.device == q_THd.device, f"{name} is on {x.device}, q on {q_THd.device}")
    _check_norm(norm_mode, q_norm_weight, k_norm_weight, q_THd, Hkv)
    check_sinks(sinks_H, H, q_THd.device)
    out_THd = torch.empty_like(q_THd)
    if T == 0 or B == 0:
        return out_THd
    G = H // Hkv
    n_split, auto_block_n = decode_tiles(B * Hkv, max_seq_len, d * k_cache_NbSHd.element_size(), q_THd.device, splits)
    block_n = block_n or auto_block_n
    split_n, part_STHd, m_STH, l_STH = split_workspace(out_THd, n_split, max_seq_len, block_n)
    ps = part_STHd.stride()[:3] + m_STH.stride()[:2] if n_split > 1 else (0, 0, 0, 0, 0)
    pdl = use_pdl(q_THd, PDL_ENV)
    rope_decode_attention_kernel[(B, n_split, Hkv)](
        q_THd, k_THd, v_THd, positions_T, cos_sin_Pd, slot_mapping_T,
        q_THd if q_norm_weight is None else q_norm_weight, k_THd if k_norm_weight is None else k_norm_weight,
        float(norm_eps), cos_sin_Pd.shape[0], k_cache_NbSHd, v_cache_NbSHd, out_THd, part_STHd, m_STH, l_STH,
        block_tables_BM, seq_lens_B, query_start_loc_B1, q_THd if sinks_H is None else sinks_H, float(scale),
        int(sliding_window or 0), q_THd.stride(0), q_THd.stride(1), k_THd.stride(0), k_THd.stride(1),
        v_THd.stride(0), v_THd.stride(1),
        cos_sin_Pd.stride(0), out_THd.stride(0), out_THd.stride(1),
        k_cache_NbSHd.stride(0), k_cache_NbSHd.stride(1), k_cache_NbSHd.stride(2),
        v_cache_NbSHd.stride(0), v_cache_NbSHd.stride(1), v_cache_NbSHd.stride(2), block_tables_BM.stride(0),
        *ps, split_n,
        G=G, HALF=d // 2, PAGE=S, BLOCK_M=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, NUM_SPLITS=n_split,
        HAS_WINDOW=sliding_window is not None, DOT_FP32=not q_THd.is_cuda,
        DOT_PRECISION="ieee" if q_THd.dtype == torch.float32 or not q_THd.is_cuda else "tf32",
        DTYPE=_TL_DTYPES[q_THd.dtype], NORM=NORM_MODES[norm_mode], HAS_SINKS=sinks_H is not None, num_warps=num_warps,
        # float32: the rotary's x*c + x*s as two roundings, as rope_store_kv; 16-bit dtypes round each product
        # by hand (rope_kv._round), and keep the attention's float32 math compiled as paged_attention_kernel's
        enable_fp_fusion=q_THd.dtype != torch.float32,
        **pdl,
    )
    if n_split > 1:
        paged_attention_reduce_kernel[(T, H)](
            part_STHd, m_STH, l_STH, out_THd, *ps, out_THd.stride(0), out_THd.stride(1),
            NUM_SPLITS=n_split, HEAD_D=d, D=d, num_warps=4, **pdl, **sinks_args(sinks_H),
        )
    return out_THd
