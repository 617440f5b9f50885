"""Launch wrapper of the MLA attention Triton kernel (`mla_attention_kernels`): the signature of
`moe_infer.layers.mla.mla_attend_torch` (which is its reference) with the attention metadata's fields spelled out.

Tiles: BLOCK_H heads of one query token a program for a decode step (every sequence one query), BLOCK_Q tokens x
BLOCK_H heads for a step with prompt chunks; key tiles of BLOCK_N rows. A decode whose B x head-group programs leave
SMs idle splits its keys (`num_splits` and `split_workspace` of the paged MHA wrapper; the same merge kernel). No
host sync: every launch parameter comes from shapes and the metadata's host ints (a decode graph's max_seq_len is its
context bucket), so steps replay as CUDA graphs.

Legend: T query tokens, B sequences, H heads, C = C_LAT + C_ROPE the cache row, Nb blocks, S block size.
"""
from __future__ import annotations

import os

import torch
import triton

from moe_infer.kernels.mla_attention_kernels import mla_attention_kernel
from moe_infer.kernels.paged_attention import num_splits, split_workspace
from moe_infer.kernels.paged_attention_kernels import paged_attention_reduce_kernel
from moe_infer.kernels.pdl import use_pdl
from moe_infer.kernels.sm_count import num_sms as _num_sms

PDL_ENV = "MOE_ATTN_PDL"
DECODE_BLOCK_H, DECODE_BLOCK_N = 16, 32  # a decode program: 16 heads x 512 latent values accumulated in float32
PREFILL_BLOCK_Q = 2  # a prompt-chunk program: 2 tokens x 16 heads


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def decode_splits(batch: int, num_heads: int, max_seq_len: int, device: torch.device) -> int:
    """The split count of a decode step of `batch` sequences over max_seq_len keys (what the start-up warm-up
    compiles for)."""
    head_groups = triton.cdiv(num_heads, DECODE_BLOCK_H if device.type == "cuda" else 4)
    return num_splits(batch * head_groups, max_seq_len, 1, _num_sms(device) if device.type == "cuda" else 4)


def mla_attention_triton(q_THC: torch.Tensor, cache_NbS1C: torch.Tensor, kv_lora_rank: int,
                         block_tables_BM: torch.Tensor, seq_lens_B: torch.Tensor, query_start_loc_B1: torch.Tensor,
                         scale: float, max_query_len: int, max_seq_len: int, splits: int | None = None) -> torch.Tensor:
    """Absorbed queries [T, H, C] over the latent cache [Nb, S, 1, C] -> [T, H, c] (c = kv_lora_rank) in q's dtype.
    A sequence's step tokens are its last positions (seq_lens_B - q_len ...). splits: force a split count (tests)."""
    T, H, C = q_THC.shape
    Nb, S, one, C_cache = cache_NbS1C.shape
    B = seq_lens_B.shape[0]
    c = int(kv_lora_rank)
    _check(one == 1 and C_cache == C and 0 < c < C, f"q {tuple(q_THC.shape)} does not fit the latent cache "
           f"{tuple(cache_NbS1C.shape)} with kv_lora_rank {c}")
    _check(q_THC.stride(2) == 1 and cache_NbS1C.stride(3) == 1, "q and the cache need a unit last stride")
    _check(q_THC.dtype == cache_NbS1C.dtype, f"q is {q_THC.dtype}, the cache {cache_NbS1C.dtype}")
    bt = block_tables_BM
    _check(bt.dim() == 2 and bt.shape[0] == B and bt.stride(1) == 1 and query_start_loc_B1.shape == (B + 1,),
           "block_tables must be [B, M] (unit last stride) and query_start_loc [B + 1]")
    for name, t in (("cache", cache_NbS1C), ("block_tables", bt), ("seq_lens", seq_lens_B),
                    ("query_start_loc", query_start_loc_B1)):
        _check(t.device == q_THC.device, f"{name} is on {t.device}, q on {q_THC.device}")
    _check(q_THC.is_cuda or os.environ.get("TRITON_INTERPRET") == "1",
           f"the Triton MLA attention needs CUDA tensors (or TRITON_INTERPRET=1), got {q_THC.device}")
    out_THc = q_THC.new_empty(T, H, c)
    if T == 0 or B == 0:
        return out_THc
    block_h = min(DECODE_BLOCK_H, max(16, triton.next_power_of_2(H))) if q_THC.is_cuda else 4
    head_groups = triton.cdiv(H, block_h)
    if max_query_len <= 1:
        block_q, warps = 1, 4
        n_split = splits or decode_splits(B, H, max_seq_len, q_THC.device)
        block_n = DECODE_BLOCK_N if q_THC.is_cuda else 16
    else:
        block_q, warps, n_split = PREFILL_BLOCK_Q, 8 if q_THC.is_cuda else 4, splits or 1
        block_n = DECODE_BLOCK_N if q_THC.is_cuda else 16
    split_n, part_STHc, m_STH, l_STH = split_workspace(out_THc, n_split, max_seq_len, block_n)
    num_q_tiles = triton.cdiv(max(max_query_len, 1), block_q)
    lat_p, rope_p = max(16, triton.next_power_of_2(c)), max(16, triton.next_power_of_2(C - c))
    mla_attention_kernel[(B, num_q_tiles * n_split, head_groups)](
        q_THC, cache_NbS1C, out_THc, part_STHc, m_STH, l_STH, bt, seq_lens_B, query_start_loc_B1,
        float(scale), q_THC.stride(0), q_THC.stride(1), out_THc.stride(0), out_THc.stride(1),
        cache_NbS1C.stride(0), cache_NbS1C.stride(1), bt.stride(0),
        part_STHc.stride(0) if n_split > 1 else 0, part_STHc.stride(1) if n_split > 1 else 0,
        part_STHc.stride(2) if n_split > 1 else 0, m_STH.stride(0) if n_split > 1 else 0,
        m_STH.stride(1) if n_split > 1 else 0, split_n,
        H=H, C_LAT=c, C_ROPE=C - c, LAT_P=lat_p, ROPE_P=rope_p, PAGE=S, BLOCK_Q=block_q, BLOCK_H=block_h,
        BLOCK_N=block_n, NUM_SPLITS=n_split, DOT_FP32=not q_THC.is_cuda,
        DOT_PRECISION="ieee" if q_THC.dtype == torch.float32 or not q_THC.is_cuda else "tf32",
        num_warps=warps, **use_pdl(q_THC, PDL_ENV),
    )
    if n_split > 1:
        paged_attention_reduce_kernel[(T, H)](
            part_STHc, m_STH, l_STH, out_THc, part_STHc.stride(0), part_STHc.stride(1), part_STHc.stride(2),
            m_STH.stride(0), m_STH.stride(1), out_THc.stride(0), out_THc.stride(1),
            NUM_SPLITS=n_split, HEAD_D=lat_p, D=c, num_warps=4, **use_pdl(q_THC, PDL_ENV),
        )
    return out_THc
