"""y = x @ W^T (+ bias) for a decode batch of at most MAX_ROWS rows, in one launch near the memory roofline.

At one to a few tokens a linear layer is a matrix-vector product: its time is the weight's bytes.
cuBLAS reaches 50-80 % of them at one row on an H100 (the attention output projection of
Qwen3-30B-A3B: a split-K GEMM plus a reduce launch, 11.0 us for 5.6 us of bytes), and a router's
small GEMM is launch-bound (4.7 us); this kernel (`skinny_gemm_kernels.py`: narrow programs with
long rows of the weight in flight) took 8.1 and 1.9 us there.
The rule and the measurements: `benchmarks/trials/skinny_gemm_sweep.py` and its log.

    skinny_gemm(x_MK, w_NK, bias_N=None, config=None) -> y_MN        the Triton kernel
    skinny_gemm_torch(x_MK, w_NK, bias_N=None) -> y_MN               the reference: float32 matmul, one rounding
    skinny_config(M, N, K, num_sms) -> SkinnyConfig                  the tile rule
    is_faster_than_cublas(M, N) -> bool                              where `layers.linear` takes it

Legend: M rows (tokens), K in features, N out features.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from moe_infer.kernels.pdl import use_pdl
from moe_infer.kernels.skinny_gemm_kernels import skinny_gemm_kernel
from moe_infer.kernels.sm_count import num_sms

MAX_ROWS = 4  # rows are a loop over the weight tile in registers: past a few, cuBLAS's tensor cores win
PDL_ENV = "MOE_SKINNY_PDL"  # "0" launches without programmatic dependent launch (A/B runs)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 4
    block_k: int = 2048
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"SkinnyConfig.{name} must be a power of two >= 1, got {v}")


def skinny_config(M: int, N: int, K: int, num_sms: int) -> SkinnyConfig:
    """4 columns a program and K tiles of 2k (16 KB of bf16 a tile), a whole row of up to 4k where the
    programs do not fill the SMs once (routers): within 0.1-0.7 us of the best tiles of the H100 sweep
    at one row."""
    block_k = 4096 if triton.cdiv(N, 4) < num_sms else 2048
    return SkinnyConfig(4, min(block_k, triton.next_power_of_2(max(K, 1))))


def is_faster_than_cublas(M: int, N: int) -> bool:
    """Where the sweep measured the kernel ahead of cuBLAS (H100, bf16): one row at every shape; up to
    MAX_ROWS rows for narrow outputs (routers, N <= 1024: launch-bound, 1.4-2.4x). For wide outputs
    at 2-4 rows the float32 multiply-adds per weight element take over and cuBLAS's tensor cores win."""
    return M == 1 or (M <= MAX_ROWS and N <= 1024)


def _num_sms(device: torch.device) -> int:
    return num_sms(device) if device.type == "cuda" else 132


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def skinny_gemm_torch(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The reference: the product (and bias) in float32, rounded once to x's dtype."""
    y_MN = x_MK.float() @ w_NK.float().t()
    if bias_N is not None:
        y_MN = y_MN + bias_N.float()
    return y_MN.to(x_MK.dtype)


def skinny_gemm(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: Optional[torch.Tensor] = None,
                config: Optional[SkinnyConfig] = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, unit last stride) @ w [N, K]^T (+ bias [N]) -> y [M, N] in x's dtype,
    float32 accumulation. config: force the tiles (tests, tuning); None chooses."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    _check(x_MK.is_cuda or interpret,
           f"skinny_gemm is a Triton kernel: it needs CUDA tensors (or TRITON_INTERPRET=1), got {x_MK.device}")
    _check(x_MK.dim() == 2 and w_NK.dim() == 2 and x_MK.shape[1] == w_NK.shape[1],
           f"x {tuple(x_MK.shape)} and w {tuple(w_NK.shape)} must be [M, K] and [N, K]")
    M, K = x_MK.shape
    N = w_NK.shape[0]
    _check(M <= MAX_ROWS, f"skinny_gemm takes at most {MAX_ROWS} rows, got {M}")
    _check(x_MK.stride(1) == 1 and w_NK.stride(1) == 1, "x and w need a unit stride on K")
    _check(w_NK.dtype == x_MK.dtype and x_MK.device == w_NK.device,
           f"w ({w_NK.dtype}, {w_NK.device}) must match x ({x_MK.dtype}, {x_MK.device})")
    if bias_N is not None:
        _check(bias_N.shape == (N,) and bias_N.is_contiguous() and bias_N.device == x_MK.device
               and bias_N.dtype == x_MK.dtype, f"bias {tuple(bias_N.shape)} {bias_N.dtype} must be a contiguous "
               f"[{N}] {x_MK.dtype} on {x_MK.device}")
    y_MN = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0 or N == 0:
        return y_MN
    if K == 0:
        return y_MN.copy_((bias_N if bias_N is not None else y_MN.new_zeros(N)).expand(M, N))
    cfg = config or skinny_config(M, N, K, _num_sms(x_MK.device))
    skinny_gemm_kernel[(triton.cdiv(N, cfg.block_n),)](
        x_MK, w_NK, bias_N if bias_N is not None else w_NK, y_MN, M, N, K, x_MK.stride(0), w_NK.stride(0),
        y_MN.stride(0), HAS_BIAS=bias_N is not None, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **use_pdl(x_MK, PDL_ENV))
    return y_MN
