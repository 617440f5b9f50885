"""The block-scaled FP8 (W8A8) experts of a one-token step as two matrix-vector kernels
(`fp8_expert_gemv_kernels.py`), in place of the tile path's five launches (schedule, activation quantization,
gate_up, down, combine) and its 16-row tiles; the fp8 counterpart of expert_gemv.py.

    fp8_expert_gemv(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD_fp8, w13_scale, w2_EDF_fp8, w2_scale,
                    block_n, block_k, config=None) -> out_TD          fused_moe_fp8's signature and contract
    fp8_gemv_config(D, F, K) -> Fp8GemvConfig                         the tile rule
    use_fp8_expert_gemv(x_TD, T) -> bool                              one token (unless MOE_EXPERT_GEMV=0)

Reference of the same signature: fp8_ref.fused_moe_fp8_ref (the same quantizations: x per token and group of
block_k, the intermediate per routed row and group, both from float32). The inputs are checked by fused_moe_fp8,
which dispatches here. No host sync, grids from shapes: a step captures in a CUDA graph.

Legend: T tokens, D hidden, F expert intermediate, E experts, K top-k, N = T*K routed rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from moe_infer.kernels.expert_gemv import ENV as GEMV_ENV
from moe_infer.kernels.fp8_expert_gemv_kernels import down_fp8_gemv_kernel, gate_up_fp8_gemv_kernel
from moe_infer.kernels.fp8_ref import FP8_MAX, SCALE_EPS
from moe_infer.kernels.pdl import use_pdl

MAX_TOKENS = 1  # each routed row streams its expert's weights: only where the rows are the experts


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_f: int = 8  # gate_up: F columns a program (gate and up rows each)
    block_g: int = 4  # gate_up: scale groups of D a weight tile
    block_d: int = 8  # down: D columns a program (all K rows, one group of F a step)
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_f", "block_g", "block_d"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Fp8GemvConfig.{name} must be a power of two >= 1, got {v}")


def fp8_gemv_config(D: int, F: int, K: int, block_k: int = 128) -> Fp8GemvConfig:
    """Tiles of about 4k weights: gate_up [8 columns, 4 groups of 128] twice (Qwen3-30B-A3B at one token:
    8 rows x 96 = 768 programs of 32 KB; DeepSeek-V3: 2048 of 112 KB), down [K rows, 8 columns, one group]
    (256 and 896 programs); fewer columns where K x 8 x block_k would pass 8k."""
    k_pad = triton.next_power_of_2(max(K, 1))
    block_d = max(1, min(8, 8192 // (k_pad * block_k)))
    block_g = min(4, triton.next_power_of_2(max(D // block_k, 1)))
    return Fp8GemvConfig(block_f=8, block_g=block_g, block_d=block_d)


def use_fp8_expert_gemv(x_TD: torch.Tensor, T: int) -> bool:
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return T <= MAX_TOKENS and (x_TD.is_cuda or interpret) and os.environ.get(GEMV_ENV, "1") != "0"


def fp8_expert_gemv(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    w13_E2FD_fp8: torch.Tensor, w13_scale: torch.Tensor, w2_EDF_fp8: torch.Tensor,
                    w2_scale: torch.Tensor, block_n: int, block_k: int,
                    config: Optional[Fp8GemvConfig] = None) -> torch.Tensor:
    """fused_moe_fp8 (inputs checked there): out_TD[t] = sum_k weight[t, k] * expert_e(x_t), ids of -1 skipped."""
    (T, K), (E, D, F) = topk_ids_TK.shape, w2_EDF_fp8.shape
    out_TD = torch.empty(T, D, dtype=x_TD.dtype, device=x_TD.device)
    if T == 0 or K == 0:
        return out_TD.zero_()
    cfg = config or fp8_gemv_config(D, F, K, block_k)
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    ids_N = topk_ids_TK.reshape(-1).contiguous()
    weights_N = topk_weights_TK.reshape(-1).contiguous()
    act_NF = torch.empty(T * K, F, dtype=torch.float32, device=x_TD.device)  # rows of dropped ids: unwritten, unread
    pdl = use_pdl(x_TD)
    common = dict(SCALE_BLOCK_N=block_n, GROUP=block_k, FP8_MAX=FP8_MAX, SCALE_EPS=SCALE_EPS, EXACT_RNE=interpret,
                  num_warps=cfg.num_warps, **pdl)
    gate_up_fp8_gemv_kernel[(T * K, triton.cdiv(F, cfg.block_f))](
        x_TD, w13_E2FD_fp8, w13_scale, ids_N, act_NF, K, D, F, E,
        x_TD.stride(0), w13_E2FD_fp8.stride(0), w13_E2FD_fp8.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        act_NF.stride(0), BLOCK_F=cfg.block_f, BLOCK_G=cfg.block_g, **common)
    down_fp8_gemv_kernel[(T, triton.cdiv(D, cfg.block_d))](
        act_NF, w2_EDF_fp8, w2_scale, ids_N, weights_N, out_TD, D, F, E,
        act_NF.stride(0), w2_EDF_fp8.stride(0), w2_EDF_fp8.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        out_TD.stride(0), TOP_K=K, K_PAD=triton.next_power_of_2(K), BLOCK_D=cfg.block_d, **common)
    return out_TD
