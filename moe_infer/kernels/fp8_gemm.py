"""Block-scaled FP8 (W8A8) launch wrappers: per-token-group quantization and the dense GEMM.

    per_token_group_quant_fp8(x_TK, group) -> (x_fp8_TK, scale_TG)
    w8a8_block_gemm(x_TK, w_NK_fp8, scale_inv, block_n, block_k, out_dtype=None) -> y_TN
    gemm_tiles(T, N, K, block_k, num_sms) -> GemmTiles        the tile rule (no autotuning)

Same signatures as the references in fp8_ref.py (there: the formulas). No host sync, grids from shapes:
both capture in a CUDA graph. Kernels: fp8_kernels.py.

Legend: T tokens, K reduction dim, N output columns, G = K / group groups, n, k weight scale blocks.
"""
from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from moe_infer.kernels.fp8_kernels import per_token_group_quant_kernel, split_sum_kernel, w8a8_block_gemm_kernel
from moe_infer.kernels.fp8_ref import FP8_DTYPE, FP8_MAX, SCALE_EPS, check_block_scale

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_FP8_DOT_K = 32  # the K tile an fp8 tensor-core dot needs on sm_89/sm_90; smaller blocks dot in bf16


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_upcast(t: torch.Tensor, block_k: int) -> int:
    """DOT_UPCAST of the kernels: 2 (float32) under the interpreter, 1 (bf16) for K tiles below the fp8
    dot's minimum, else 0 (fp8 operands)."""
    if is_interpreter() or not t.is_cuda:
        return 2
    return 1 if block_k < MIN_FP8_DOT_K else 0


def check_device(t: torch.Tensor) -> None:
    _check(t.is_cuda or is_interpreter(), f"the Triton kernels need CUDA tensors or TRITON_INTERPRET=1, got {t.device}")


def per_token_group_quant_fp8(x_TK: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8_TK float8_e4m3fn, scale_TG float32) with x_TK ~= x_fp8 * scale per group of `group` values."""
    _check(x_TK.dim() == 2, f"x must be 2-D [T, K], got {tuple(x_TK.shape)}")
    _check(x_TK.dtype in ACT_DTYPES, f"x must be one of {ACT_DTYPES}, got {x_TK.dtype}")
    T, K = x_TK.shape
    _check(group >= 1 and K % group == 0, f"K={K} must be a multiple of the group size {group}")
    _check(x_TK.stride(1) == 1 or K <= 1, f"x needs a unit stride along K, got strides {x_TK.stride()}")
    check_device(x_TK)
    G = K // group
    x_fp8 = torch.empty(T, K, dtype=FP8_DTYPE, device=x_TK.device)
    scale_TG = torch.empty(T, G, dtype=torch.float32, device=x_TK.device)
    if T == 0 or K == 0:
        return x_fp8, scale_TG
    group_pad = triton.next_power_of_2(group)
    block_g = min(triton.next_power_of_2(G), max(1, 4096 // group_pad))  # up to 4k values a program
    per_token_group_quant_kernel[(T, triton.cdiv(G, block_g))](
        x_TK, x_fp8, scale_TG, T, G, x_TK.stride(0), x_fp8.stride(0), scale_TG.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_G=block_g, FP8_MAX=FP8_MAX, SCALE_EPS=SCALE_EPS,
        EXACT_RNE=is_interpreter(), num_warps=4,
    )
    return x_fp8, scale_TG


@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


QUANT_IN_GEMM_MAX_T = 16  # up to this many tokens the GEMM quantizes x in its prologue (no quantization launch)
SPLIT_K_WAVES = 2  # few tokens: split K until the programs fill the SMs this many times over
MIN_K_BLOCKS_A_SPLIT = 4  # ... keeping at least this many K blocks a program


def gemm_tiles(T: int, N: int, K: int, block_k: int, num_sms: int) -> GemmTiles:
    """Few tokens: 16-row tiles (weight-bound; more programs along N); up to 64, 64 x 64; up to 256, 64 x 128; more:
    128 x 128. Up to 256 tokens, where the output tiles do not fill the SMs, K is split over programs until they
    fill them SPLIT_K_WAVES times (a GEMM of N 4096 x K 7168 has 64 output tiles at one row, 32 at 64 rows, for 132
    SMs: each program would stream a whole K slice of the weight alone; on an H200 the split took one row from 25 to
    16 us, N 7168 x K 16384 from 79 to 41). The K tile is block_k (one scale per K step). Untuned otherwise: a rule in
    the spirit of vLLM's fp8 defaults."""
    if T > 256:
        return GemmTiles(128, 128, num_warps=8)
    if T <= 16:
        base = GemmTiles(16, 64 if N <= 4096 else 128, num_stages=4 if block_k <= 128 else 3)
    else:
        base = GemmTiles(64, 64 if T <= 64 else 128)
    tiles = triton.cdiv(T, base.block_m) * triton.cdiv(N, base.block_n)
    if tiles >= num_sms:
        return base
    split = max(1, min(triton.cdiv(SPLIT_K_WAVES * num_sms, tiles), K // block_k // MIN_K_BLOCKS_A_SPLIT))
    return dataclasses.replace(base, split_k=split)


def _num_sms(t: torch.Tensor) -> int:
    if not t.is_cuda:
        return 8  # the interpreter's stand-in: small enough that its tests split
    from moe_infer.kernels.sm_count import num_sms

    return num_sms(t.device)


def w8a8_block_gemm(x_TK: torch.Tensor, w_NK_fp8: torch.Tensor, scale_inv: torch.Tensor, block_n: int,
                    block_k: int, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y_TN = x_TK @ dequant(w_NK_fp8)^T, W8A8: x quantized per token group of block_k (up to
    QUANT_IN_GEMM_MAX_T tokens in the GEMM's prologue, else by per_token_group_quant_fp8), then one GEMM with an fp8
    dot per K block, the block scales applied to each block's float32 partial sum. Launches: one, or two where K is
    split (the partial sums' kernel); three from 17 tokens on, where the quantization has its own.
    out_dtype: x's dtype by default. K must be a multiple of block_k; N need not be of block_n."""
    _check(x_TK.dim() == 2 and w_NK_fp8.dim() == 2, f"x {tuple(x_TK.shape)} and w {tuple(w_NK_fp8.shape)} must be 2-D")
    (T, K), N = x_TK.shape, w_NK_fp8.shape[0]
    _check(w_NK_fp8.shape[1] == K, f"x is [T, {K}] but w is {tuple(w_NK_fp8.shape)}")
    check_block_scale(w_NK_fp8, scale_inv, block_n, block_k, "w")
    _check(block_k & (block_k - 1) == 0, f"the Triton GEMM's K tile is block_k: a power of two, got {block_k}")
    _check(w_NK_fp8.stride(1) == 1 and scale_inv.stride(1) == 1, "w and its scale need a unit last stride")
    _check(x_TK.device == w_NK_fp8.device, f"x on {x_TK.device}, w on {w_NK_fp8.device}")
    out_dtype = out_dtype or x_TK.dtype
    _check(out_dtype in ACT_DTYPES, f"out_dtype must be one of {ACT_DTYPES}, got {out_dtype}")
    _check(x_TK.dtype in ACT_DTYPES, f"x must be one of {ACT_DTYPES}, got {x_TK.dtype}")
    _check(K % block_k == 0, f"K={K} must be a multiple of the group size {block_k}")
    _check(x_TK.stride(1) == 1 or K <= 1, f"x needs a unit stride along K, got strides {x_TK.stride()}")
    check_device(x_TK)
    if T == 0 or N == 0:
        return torch.empty(T, N, dtype=out_dtype, device=x_TK.device)
    quant_a = T <= QUANT_IN_GEMM_MAX_T  # x quantized in the GEMM's prologue, else by its own launch
    x_in, xs_in = (x_TK, x_TK) if quant_a else per_token_group_quant_fp8(x_TK, block_k)
    tiles = gemm_tiles(T, N, K, block_k, _num_sms(x_TK))
    split = tiles.split_k
    # split: float32 partial tiles [split, T, N], summed after in split order (deterministic)
    y_STN = torch.empty(split, T, N, dtype=out_dtype if split == 1 else torch.float32, device=x_TK.device)
    grid = (triton.cdiv(T, tiles.block_m) * triton.cdiv(N, tiles.block_n), split)
    w8a8_block_gemm_kernel[grid](
        x_in, xs_in, w_NK_fp8, scale_inv, y_STN, T, N, K,
        x_in.stride(0), 0 if quant_a else xs_in.stride(0), w_NK_fp8.stride(0), scale_inv.stride(0), y_STN.stride(1),
        SCALE_BLOCK_N=block_n, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        GROUP_M=tiles.group_m, DOT_UPCAST=dot_upcast(x_TK, block_k), SPLIT_K=split, QUANT_A=quant_a,
        FP8_MAX=FP8_MAX, SCALE_EPS=SCALE_EPS, EXACT_RNE=is_interpreter(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if split == 1:
        return y_STN[0]
    y_TN = torch.empty(T, N, dtype=out_dtype, device=x_TK.device)
    block = 1024
    split_sum_kernel[(triton.cdiv(T * N, block),)](y_STN, y_TN, T * N, SPLIT_K=split, BLOCK=block, num_warps=4)
    return y_TN
