"""Launch wrapper of the MLA attention Triton kernel (`mla_attention_kernels`): the signature of
`moe_infer.layers.mla.mla_attend_torch` (which is its reference) with the attention metadata's fields spelled out.

Tiles (`TileConfig`): BLOCK_H heads of one query token a program for a decode step (every sequence one query),
BLOCK_Q tokens x BLOCK_H heads for a step with prompt chunks; key tiles of BLOCK_N rows; the value accumulator in
parts of BLOCK_V latent values (one program each). `benchmarks/deepseek_v3.py` times the
candidates. A decode whose B x head-group programs leave
SMs idle splits its keys (`num_splits` and `split_workspace` of the paged MHA wrapper; the same merge kernel). No
host sync: every launch parameter comes from shapes and the metadata's host ints (a decode graph's max_seq_len is its
context bucket), so steps replay as CUDA graphs.

Legend: T query tokens, B sequences, H heads, C = C_LAT + C_ROPE the cache row, Nb blocks, S block size.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from moe_infer.kernels.mla_attention_kernels import mla_attention_kernel
from moe_infer.kernels.paged_attention import PDL_ENV, merge_splits, num_splits, split_workspace
from moe_infer.kernels.pdl import use_pdl
from moe_infer.kernels.sm_count import num_sms as _num_sms



@dataclass(frozen=True)
class TileConfig:
    block_h: int  # heads a program (x block_q tokens: its rows)
    block_v: int  # latent values a program accumulates (< kv_lora_rank: the value split over programs)
    block_n: int  # keys a tile
    warps: int
    block_q: int = 1  # query tokens a program (steps with prompt chunks)


DECODE_CUDA = TileConfig(block_h=16, block_v=512, block_n=32, warps=4)
PREFILL_CUDA = TileConfig(block_h=16, block_v=512, block_n=32, warps=8, block_q=2)
INTERPRETER = TileConfig(block_h=4, block_v=512, block_n=16, warps=4, block_q=2)  # its speed: small tiles


def tile_config(is_decode: bool, device: torch.device) -> TileConfig:
    if device.type != "cuda":
        return INTERPRETER
    return DECODE_CUDA if is_decode else PREFILL_CUDA


def _programs_per_seq(cfg: TileConfig, num_heads: int, kv_lora_rank: int) -> int:
    return triton.cdiv(num_heads, cfg.block_h) * triton.cdiv(kv_lora_rank, min(cfg.block_v, kv_lora_rank))


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def decode_splits(batch: int, num_heads: int, max_seq_len: int, device: torch.device, kv_lora_rank: int = 512,
                  cfg: TileConfig | None = None) -> int:
    """The split count of a decode step of `batch` sequences over max_seq_len keys (what the start-up warm-up
    compiles for)."""
    cfg = cfg or tile_config(True, device)
    programs = batch * _programs_per_seq(cfg, num_heads, kv_lora_rank)
    return num_splits(programs, max_seq_len, 1, _num_sms(device) if device.type == "cuda" else 4)


def mla_attention_triton(q_THC: torch.Tensor, cache_NbS1C: torch.Tensor, kv_lora_rank: int,
                         block_tables_BM: torch.Tensor, seq_lens_B: torch.Tensor, query_start_loc_B1: torch.Tensor,
                         scale: float, max_query_len: int, max_seq_len: int, splits: int | None = None,
                         config: TileConfig | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed queries [T, H, C] over the latent cache [Nb, S, 1, C] -> [T, H, c] (c = kv_lora_rank) in q's dtype.
    A sequence's step tokens are its last positions (seq_lens_B - q_len ...). splits, config: force a split count,
    a tile configuration (tests, benchmarks). An fp8 (e4m3) cache holds rows / kv_scale (float32 [1], on q's
    device): read in q's dtype, kv_scale folded into the scores and the output."""
    T, H, C = q_THC.shape
    Nb, S, one, C_cache = cache_NbS1C.shape
    B = seq_lens_B.shape[0]
    c = int(kv_lora_rank)
    _check(one == 1 and C_cache == C and 0 < c < C, f"q {tuple(q_THC.shape)} does not fit the latent cache "
           f"{tuple(cache_NbS1C.shape)} with kv_lora_rank {c}")
    _check(q_THC.stride(2) == 1 and cache_NbS1C.stride(3) == 1, "q and the cache need a unit last stride")
    kv_fp8 = cache_NbS1C.dtype == torch.float8_e4m3fn
    _check(q_THC.dtype == cache_NbS1C.dtype or kv_fp8, f"q is {q_THC.dtype}, the cache {cache_NbS1C.dtype}")
    if kv_fp8:
        _check(kv_scale is not None and kv_scale.dtype == torch.float32 and tuple(kv_scale.shape) == (1,)
               and kv_scale.device == q_THC.device,
               f"an fp8 latent cache needs kv_scale float32 [1] on {q_THC.device}, got "
               f"{None if kv_scale is None else (kv_scale.dtype, tuple(kv_scale.shape), kv_scale.device)}")
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
    decode = max_query_len <= 1
    cfg = config or tile_config(decode, q_THC.device)
    lat_p, rope_p = max(16, triton.next_power_of_2(c)), max(16, triton.next_power_of_2(C - c))
    block_q = 1 if decode else cfg.block_q
    block_v = min(cfg.block_v, lat_p)
    _check(block_v & (block_v - 1) == 0 and cfg.block_h & (cfg.block_h - 1) == 0,
           f"tile config {cfg}: block_v and block_h must be powers of two")
    n_split = splits or (decode_splits(B, H, max_seq_len, q_THC.device, c, cfg) if decode else 1)
    split_n, part_STHc, m_STH, l_STH = split_workspace(out_THc, n_split, max_seq_len, cfg.block_n)
    num_q_tiles = triton.cdiv(max(max_query_len, 1), block_q)
    v_parts = triton.cdiv(c, block_v)
    mla_attention_kernel[(B, num_q_tiles * n_split, triton.cdiv(H, cfg.block_h) * v_parts)](
        q_THC, cache_NbS1C, out_THc, part_STHc, m_STH, l_STH, bt, seq_lens_B, query_start_loc_B1,
        float(scale), kv_scale if kv_fp8 else seq_lens_B, q_THC.stride(0), q_THC.stride(1), out_THc.stride(0),
        out_THc.stride(1),
        cache_NbS1C.stride(0), cache_NbS1C.stride(1), bt.stride(0),
        part_STHc.stride(0) if n_split > 1 else 0, part_STHc.stride(1) if n_split > 1 else 0,
        part_STHc.stride(2) if n_split > 1 else 0, m_STH.stride(0) if n_split > 1 else 0,
        m_STH.stride(1) if n_split > 1 else 0, split_n,
        H=H, C_LAT=c, C_ROPE=C - c, LAT_P=lat_p, ROPE_P=rope_p, PAGE=S, BLOCK_Q=block_q, BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n, BLOCK_V=block_v, V_PARTS=v_parts, NUM_SPLITS=n_split, DOT_FP32=not q_THC.is_cuda,
        DOT_PRECISION="ieee" if q_THC.dtype == torch.float32 or not q_THC.is_cuda else "tf32",
        KV_FP8=kv_fp8, num_warps=cfg.warps, **use_pdl(q_THC, PDL_ENV),
    )
    if n_split > 1:
        merge_splits(part_STHc, m_STH, l_STH, out_THc, lat_p)
    return out_THc
