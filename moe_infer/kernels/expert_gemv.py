"""The experts of a one-token step as two matrix-vector kernels (`expert_gemv_kernels.py`), in place of
the tile GEMMs' three launches (gate_up, down, combine).

    expert_gemv(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, w2_EDF, expert_start=0, config=None) -> out_TD
    expert_gemv_torch(...)            the reference, same signature: a loop over routed rows with the
                                      kernels' rounding steps (act and each weighted row rounded once)
    gemv_config(D, F, K) -> GemvConfig  the tile rule
    use_expert_gemv(x_TD, T) -> bool  where `fused_experts` takes this path: one token on a CUDA device,
                                      unless MOE_EXPERT_GEMV=0 (A/B runs)

At one token a layer's experts are K matrix-vector products: the time is the bytes of K experts. The tile
path pads every routed row to a 16-row tile and leaves SMs idle at that size (Qwen3-30B-A3B on an H100:
38 us for 25 us of bytes, fused_moe_NVIDIA_H100_80GB_HBM3.json); this path's measurements are in
benchmarks/trials/expert_gemv_ab.py and its log.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k, N = T*K routed rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F_
import triton

from moe_infer.kernels.expert_gemv_kernels import down_gemv_kernel, gate_up_gemv_kernel
from moe_infer.kernels.pdl import use_pdl

ENV = "MOE_EXPERT_GEMV"  # "0": one-token steps take the tile GEMMs (A/B runs)
MAX_TOKENS = 1  # the path reads an expert's weights once per routed row: only where rows are the experts


@dataclass(frozen=True)
class GemvConfig:
    block_f: int = 4  # gate_up: F columns a program (gate and up rows each)
    block_k: int = 2048  # gate_up: D per weight tile
    block_d: int = 4  # down: D columns a program
    block_df: int = 1024  # down: F per weight tile
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_f", "block_k", "block_d", "block_df"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= 1, got {v}")


def gemv_config(D: int, F: int, K: int) -> GemvConfig:
    """gate_up: 4 columns a program, weight rows in tiles of up to 2k elements; down: tiles of up to 1k of F
    for all K rows at once, as many D columns (up to 4) as keep that tile at 16k elements."""
    block_df = min(1024, triton.next_power_of_2(F))
    block_d = max(1, min(4, 16384 // (triton.next_power_of_2(K) * block_df)))
    return GemvConfig(block_f=4, block_k=min(2048, triton.next_power_of_2(D)), block_d=block_d, block_df=block_df)


def use_expert_gemv(x_TD: torch.Tensor, T: int) -> bool:
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return T <= MAX_TOKENS and (x_TD.is_cuda or interpret) and os.environ.get(ENV, "1") != "0"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_inputs(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, w2_EDF) -> None:
    _check(x_TD.dim() == 2 and topk_ids_TK.dim() == 2 and topk_ids_TK.shape == topk_weights_TK.shape
           and topk_ids_TK.shape[0] == x_TD.shape[0],
           f"x_TD {tuple(x_TD.shape)}, topk_ids_TK {tuple(topk_ids_TK.shape)} and topk_weights_TK "
           f"{tuple(topk_weights_TK.shape)} disagree")
    E, F2, D = w13_E2FD.shape
    _check(F2 % 2 == 0 and x_TD.shape[1] == D, f"w13_E2FD {tuple(w13_E2FD.shape)} must be [E, 2F, D={x_TD.shape[1]}]")
    _check(tuple(w2_EDF.shape) == (E, D, F2 // 2), f"w2_EDF {tuple(w2_EDF.shape)} must be [{E}, {D}, {F2 // 2}]")
    for name, w in (("w13_E2FD", w13_E2FD), ("w2_EDF", w2_EDF)):
        _check(w.dtype == x_TD.dtype and w.device == x_TD.device and w.stride(2) == 1,
               f"{name} ({w.dtype}, {w.device}) must match x ({x_TD.dtype}, {x_TD.device}) with a unit last stride")
    _check(x_TD.stride(1) == 1, "x_TD needs a unit last stride")


def expert_gemv(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor, expert_start: int = 0,
                config: Optional[GemvConfig] = None) -> torch.Tensor:
    """fused_experts' contract (moe_infer.kernels.fused_moe): rows routed to experts outside
    [expert_start, expert_start + E) or dropped (id -1) add nothing."""
    _check_inputs(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, w2_EDF)
    (T, K), (E, F2, D) = topk_ids_TK.shape, w13_E2FD.shape
    F = F2 // 2
    out_TD = torch.empty(T, D, dtype=x_TD.dtype, device=x_TD.device)
    if T == 0:
        return out_TD
    cfg = config or gemv_config(D, F, K)
    ids_N = topk_ids_TK.reshape(-1).contiguous()
    act_NF = torch.empty(T * K, F, dtype=x_TD.dtype, device=x_TD.device)
    pdl = use_pdl(x_TD)
    gate_up_gemv_kernel[(T * K, triton.cdiv(F, cfg.block_f))](
        x_TD, w13_E2FD, ids_N, act_NF, K, D, F, expert_start, E,
        x_TD.stride(0), w13_E2FD.stride(0), w13_E2FD.stride(1), act_NF.stride(0),
        BLOCK_F=cfg.block_f, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **pdl)
    down_gemv_kernel[(T, triton.cdiv(D, cfg.block_d))](
        act_NF, w2_EDF, ids_N, topk_weights_TK.reshape(-1).contiguous(), out_TD, D, F, expert_start, E,
        act_NF.stride(0), w2_EDF.stride(0), w2_EDF.stride(1), out_TD.stride(0),
        TOP_K=K, K_PAD=triton.next_power_of_2(K), BLOCK_D=cfg.block_d, BLOCK_F=cfg.block_df,
        num_warps=cfg.num_warps, **pdl)
    return out_TD


def expert_gemv_torch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                      w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor, expert_start: int = 0,
                      config: Optional[GemvConfig] = None) -> torch.Tensor:
    """The reference: per token, per local routed row, float32 products with the kernels' roundings (act,
    then each weighted row, then the sum; the kernel sums the rows in another order)."""
    _check_inputs(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, w2_EDF)
    E, F = w13_E2FD.shape[0], w13_E2FD.shape[1] // 2
    out_TD = torch.zeros(x_TD.shape, dtype=x_TD.dtype, device=x_TD.device)
    for t in range(x_TD.shape[0]):
        total_D = torch.zeros(x_TD.shape[1], dtype=torch.float32, device=x_TD.device)
        for k in range(topk_ids_TK.shape[1]):
            raw = int(topk_ids_TK[t, k])
            e = raw - expert_start
            if raw < 0 or not 0 <= e < E:
                continue
            h = w13_E2FD[e].float() @ x_TD[t].float()
            act = (F_.silu(h[:F]) * h[F:]).to(x_TD.dtype)
            y = (w2_EDF[e].float() @ act.float()) * topk_weights_TK[t, k].float()
            total_D += y.to(x_TD.dtype).float()
        out_TD[t] = total_D.to(x_TD.dtype)
    return out_TD
