"""Launch wrapper of the paged-attention Triton kernels (`paged_attention_kernels`): the signature of
`moe_infer.layers.paged_attention.paged_attention_ref`, which is its reference.

Tile choice: a decode-only step (every sequence has one query token) puts the G heads of a KV head
in one tile (BLOCK_M = max(16, G) rows); a step with prefill chunks takes BLOCK_Q = 128 // G tokens
per tile on the GPU for 16-bit inputs (64 // G for float32 and under the interpreter). Split-KV is
used for decode steps whose B * Hkv programs would leave SMs idle (`num_splits`), with a merge launch after; their
key tile shrinks with a split's keys (`decode_block_n`). A prefill of one to four waves of programs runs its
longest query tiles first (`heavy_tiles_first`; paged_attention_kernels' docstring). No host sync:
every launch parameter comes from shapes and the host ints of the attention metadata (a CUDA
graph's max_seq_len is its context bucket, so the split count and order are fixed per capture).

Legend: T query tokens, B sequences, M max blocks per sequence, H query heads, Hkv KV heads,
G = H / Hkv, d head_dim, Nb cache blocks, S block size.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton

from moe_infer.kernels.paged_attention_kernels import paged_attention_kernel, paged_attention_reduce_kernel
from moe_infer.kernels.pdl import use_pdl
from moe_infer.kernels.sm_count import num_sms as _num_sms

# Decode tiles (`num_splits`, `decode_block_n`), measured on an H100 with Qwen3-30B-A3B heads as the time per call
# in a graph of 20 calls in a row, as a decode step's graph runs them under PDL
# (benchmarks/trials/decode_attention_tiles.py, results/trials/decode_attention_tiles_*): up to SHORT_CONTEXT keys,
# splits of >= SHORT_SPLIT_KEYS keys that fill one wave of programs (one sequence over 256 keys 8.9 -> 6.2 us: 8
# splits of 32 keys instead of 2 of 128); longer contexts, about two waves of >= SPLIT_MIN_KEYS keys a split. The key
# tile is half a split's keys, 32 to 128 (fewer dependent tile loads a program), at most MAX_TILE_BYTES of keys (as
# the 64-key tiles of 128 float32 or 256 16-bit dims before).
SHORT_CONTEXT = 2048
SHORT_SPLIT_KEYS = 32
SPLIT_MIN_KEYS = 128
MAX_SPLITS = 64
MAX_TILE_BYTES = 32768
PDL_ENV = "MOE_ATTN_PDL"  # "0" launches both kernels without programmatic dependent launch (A/B runs)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def num_splits(batch_kv_programs: int, max_seq_len: int, max_query_len: int, num_sms: int) -> int:
    """Splits of the key range for a decode step whose B * Hkv programs leave SMs idle (see the constants above);
    a power of two (the merge kernel's tl.arange)."""
    if max_query_len > 1 or batch_kv_programs >= num_sms:
        return 1
    if max_seq_len <= SHORT_CONTEXT:
        want = min(MAX_SPLITS, max(1, max_seq_len // SHORT_SPLIT_KEYS), max(1, num_sms // batch_kv_programs))
        if want < 4 and max_seq_len <= 256:  # two splits of a short context do not pay for the merge
            want = 1
    else:
        want = min(MAX_SPLITS, max(1, max_seq_len // SPLIT_MIN_KEYS), triton.cdiv(2 * num_sms, batch_kv_programs))
    return 1 << (want.bit_length() - 1)


def decode_block_n(batch_kv_programs: int, max_seq_len: int, n_split: int, num_sms: int, key_bytes: int) -> int:
    """Key tile of a decode step on the GPU: 64 where the programs fill the SMs, else half a split's keys (a power
    of two, 32 to 128); at most MAX_TILE_BYTES of keys of key_bytes each (head_dim * element size), at least 32."""
    if batch_kv_programs >= num_sms:
        return 64
    keys = triton.next_power_of_2(triton.cdiv(max(max_seq_len, 1), n_split))
    cap = max(32, min(128, MAX_TILE_BYTES // max(key_bytes, 1)))
    return min(cap, max(32, keys // 2))


def decode_tiles(batch_kv_programs: int, max_seq_len: int, key_bytes: int, device: torch.device,
                 splits: Optional[int] = None) -> Tuple[int, int]:
    """(split count, key tile) of a decode step: `num_splits` (or the forced `splits`) and `decode_block_n` on
    CUDA; under the interpreter 4 SMs and 16-key tiles (its speed). Both decode kernels launch with these, and
    the engine's start-up warm-up compiles every pair its steps can select (moe_infer/engine/warmup.py)."""
    sms = _num_sms(device) if device.type == "cuda" else 4
    n_split = splits if splits is not None else num_splits(batch_kv_programs, max_seq_len, 1, sms)
    if device.type != "cuda":
        return n_split, 16
    return n_split, decode_block_n(batch_kv_programs, max_seq_len, n_split, sms, key_bytes)


def split_workspace(out_THd: torch.Tensor, n_split: int, max_seq_len: int, block_n: int):
    """(keys a split, partial outputs [S, T, H, d], row maxima [S, T, H], row sums [S, T, H]) of a split-KV decode
    (float32; with one split no workspace: out_THd in their place, not read)."""
    _check(n_split >= 1 and n_split & (n_split - 1) == 0, f"splits must be a power of two, got {n_split}")
    split_n = triton.cdiv(triton.cdiv(max(max_seq_len, 1), n_split), block_n) * block_n
    if n_split == 1:
        return split_n, out_THd, out_THd, out_THd
    T, H, d = out_THd.shape
    m_STH = torch.empty((n_split, T, H), dtype=torch.float32, device=out_THd.device)
    return (split_n, torch.empty((n_split, T, H, d), dtype=torch.float32, device=out_THd.device), m_STH,
            torch.empty_like(m_STH))


def merge_splits(part_STHd: torch.Tensor, m_STH: torch.Tensor, l_STH: torch.Tensor, out_THd: torch.Tensor,
                 head_d: int, sinks_H: Optional[torch.Tensor] = None) -> None:
    """out_THd <- the split-KV partial outputs merged (`paged_attention_reduce_kernel`; head_d: the padded width;
    sinks_H: the heads' sink logits, added to the denominators)."""
    T, H, d = out_THd.shape
    paged_attention_reduce_kernel[(T, H)](
        part_STHd, m_STH, l_STH, out_THd, part_STHd.stride(0), part_STHd.stride(1), part_STHd.stride(2),
        m_STH.stride(0), m_STH.stride(1), out_THd.stride(0), out_THd.stride(1),
        NUM_SPLITS=part_STHd.shape[0], HEAD_D=head_d, D=d, num_warps=4, **use_pdl(out_THd, PDL_ENV),
        **sinks_args(sinks_H),
    )


def sinks_args(sinks_H: Optional[torch.Tensor]) -> dict:
    """The kernels' sink arguments: none without sinks (the kernels' defaults), else the pointer and HAS_SINKS."""
    return {} if sinks_H is None else {"sinks_ptr": sinks_H, "HAS_SINKS": True}


def check_sinks(sinks_H: Optional[torch.Tensor], H: int, device: torch.device) -> None:
    if sinks_H is None:
        return
    _check(tuple(sinks_H.shape) == (H,) and sinks_H.is_contiguous(),
           f"sinks {tuple(sinks_H.shape)} must be one contiguous logit per query head ({H})")
    _check(sinks_H.device == device, f"sinks are on {sinks_H.device}, q on {device}")


def heavy_tiles_first(num_q_tiles: int, batch_kv_programs: int, num_sms: int) -> bool:
    """Dispatch the last (longest) query tiles first: a prefill whose programs fill the SMs one to four
    times over (with fewer there is no tail to even out; with more the plain order measured faster)."""
    programs = num_q_tiles * batch_kv_programs
    return num_q_tiles > 1 and num_sms < programs <= 4 * num_sms


def paged_attention_triton(
    q_THd: torch.Tensor, k_cache_NbSHd: torch.Tensor, v_cache_NbSHd: torch.Tensor, block_tables_BM: torch.Tensor,
    seq_lens_B: torch.Tensor, query_start_loc_B1: torch.Tensor, positions_T: torch.Tensor, scale: float,
    max_query_len: int, max_seq_len: int, sliding_window: Optional[int] = None, sinks_H: Optional[torch.Tensor] = None,
    splits: Optional[int] = None, heavy_first: Optional[bool] = None, k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [T, H, d] -> out [T, H, d] over the cached keys of each token's sequence (float32 softmax); sinks_H: a
    logit per query head in each softmax's denominator (GPT-OSS).

    An fp8 (e4m3) cache holds k / k_scale[h] and v / v_scale[h] (float32 [Hkv]): the kernel reads it in q's dtype,
    folds k_scale into the score scale and v_scale into the output.

    positions_T is not read: a sequence's step tokens are its last positions (seq_lens_B - q_len ...),
    which is what the model runner builds. splits, heavy_first: force a split count, a program order (tests);
    None chooses."""
    T, H, d = q_THd.shape
    Nb, S, Hkv, dk = k_cache_NbSHd.shape
    B = seq_lens_B.shape[0]
    _check(dk == d and H % Hkv == 0 and v_cache_NbSHd.shape == k_cache_NbSHd.shape,
           f"q {tuple(q_THd.shape)} does not fit caches k {tuple(k_cache_NbSHd.shape)} / v "
           f"{tuple(v_cache_NbSHd.shape)} (GQA needs H % Hkv == 0)")
    _check(q_THd.stride(2) == 1 and k_cache_NbSHd.stride(3) == 1 and v_cache_NbSHd.stride(3) == 1,
           "q and the caches need a unit stride on head_dim")
    _check(query_start_loc_B1.shape == (B + 1,) and block_tables_BM.dim() == 2 and block_tables_BM.shape[0] == B,
           f"query_start_loc {tuple(query_start_loc_B1.shape)} must be [B+1] and block_tables [B, M], B = {B}")
    _check(block_tables_BM.stride(1) == 1, "block_tables needs a unit last stride")
    for name, t in (("k_cache", k_cache_NbSHd), ("v_cache", v_cache_NbSHd), ("block_tables", block_tables_BM),
                    ("seq_lens", seq_lens_B), ("query_start_loc", query_start_loc_B1)):
        _check(t.device == q_THd.device, f"{name} is on {t.device}, q on {q_THd.device}")
    check_sinks(sinks_H, H, q_THd.device)
    _check(q_THd.is_cuda or os.environ.get("TRITON_INTERPRET") == "1",
           f"the Triton paged attention needs CUDA tensors (or TRITON_INTERPRET=1), got {q_THd.device}")
    kv_fp8 = k_cache_NbSHd.dtype == torch.float8_e4m3fn
    _check(v_cache_NbSHd.dtype == k_cache_NbSHd.dtype, "the K and V caches must have one dtype")
    if kv_fp8:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check(t is not None and t.dtype == torch.float32 and tuple(t.shape) == (Hkv,) and t.device == q_THd.device,
                   f"an fp8 KV cache needs {name} float32 [{Hkv}] on {q_THd.device}, got "
                   f"{None if t is None else (t.dtype, tuple(t.shape))}")
    out_THd = torch.empty_like(q_THd)
    if T == 0 or B == 0:
        return out_THd
    G = H // Hkv
    if max_query_len <= 1:
        block_q, block_m, warps = 1, max(16, triton.next_power_of_2(G)), 4
    else:  # 128-row tiles (wgmma, no spill in the offline sm_90 build) for 16-bit inputs on the GPU
        rows = 128 if q_THd.is_cuda and q_THd.dtype != torch.float32 else 64
        block_q = max(1, rows // G)
        block_m, warps = max(16, triton.next_power_of_2(block_q * G)), 8 if rows == 128 else 4
    sms = _num_sms(q_THd.device) if q_THd.is_cuda else 4
    if max_query_len <= 1:
        n_split, block_n = decode_tiles(B * Hkv, max_seq_len, d * k_cache_NbSHd.element_size(), q_THd.device, splits)
    else:
        n_split, block_n = splits or 1, 64 if q_THd.is_cuda else 16
    split_n, part_STHd, m_STH, l_STH = split_workspace(out_THd, n_split, max_seq_len, block_n)
    head_d = max(16, triton.next_power_of_2(d))  # tl.dot needs K >= 16
    num_q_tiles = triton.cdiv(max(max_query_len, 1), block_q)
    if heavy_first is None:
        heavy_first = heavy_tiles_first(num_q_tiles, B * Hkv, sms)
    grid = (B * Hkv, num_q_tiles * n_split) if heavy_first else (B, num_q_tiles * n_split, Hkv)
    paged_attention_kernel[grid](
        q_THd, k_cache_NbSHd, v_cache_NbSHd, out_THd, part_STHd, m_STH, l_STH,
        block_tables_BM, seq_lens_B, query_start_loc_B1, q_THd if sinks_H is None else sinks_H, float(scale),
        int(sliding_window or 0), k_scale if kv_fp8 else seq_lens_B, v_scale if kv_fp8 else seq_lens_B,
        q_THd.stride(0), q_THd.stride(1), out_THd.stride(0), out_THd.stride(1),
        k_cache_NbSHd.stride(0), k_cache_NbSHd.stride(1), k_cache_NbSHd.stride(2),
        v_cache_NbSHd.stride(0), v_cache_NbSHd.stride(1), v_cache_NbSHd.stride(2),
        block_tables_BM.stride(0),
        part_STHd.stride(0) if n_split > 1 else 0, part_STHd.stride(1) if n_split > 1 else 0,
        part_STHd.stride(2) if n_split > 1 else 0, m_STH.stride(0) if n_split > 1 else 0,
        m_STH.stride(1) if n_split > 1 else 0, split_n,
        G=G, HKV=Hkv, HEAD_D=head_d, D=d, PAGE=S, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_SPLITS=n_split, HEAVY_FIRST=heavy_first, HAS_WINDOW=sliding_window is not None,
        DOT_FP32=not q_THd.is_cuda,
        DOT_PRECISION="ieee" if q_THd.dtype == torch.float32 or not q_THd.is_cuda else "tf32",
        HAS_SINKS=sinks_H is not None, KV_FP8=kv_fp8, num_warps=warps, **use_pdl(q_THd, PDL_ENV),
    )
    if n_split > 1:
        merge_splits(part_STHd, m_STH, l_STH, out_THd, head_d, sinks_H)
    return out_THd
