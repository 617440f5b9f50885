"""Launch wrappers of the fused MoE path (kernels in fused_moe_align.py and fused_moe_gemm.py).

    fused_experts(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, w2_EDF) -> out_TD
        = block_schedule (no launch for decode: the GEMMs derive it; 1-2 launches else)
      -> gate_up -> down -> combine_topk

No host sync: every grid is sized from shapes alone (P_max = N + min(E, N) * (BLOCK_M - 1) padded
slots bound the schedule), so a decode step captures in a CUDA graph. Each function has a PyTorch
reference of the same signature in fused_moe_ref.py.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k, N = T*K routed rows,
P padded slots, B tiles.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from moe_infer.kernels.fused_moe_align import align_count_kernel, align_scatter_kernel
from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig, get_config
from moe_infer.kernels.fused_moe_gemm import combine_kernel, down_kernel, gate_up_kernel

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class BlockSchedule:
    sorted_P: torch.Tensor  # int32 [P_max]: routed row of each padded slot, num_rows for a pad slot
    expert_B: torch.Tensor  # int32 [B_max]: local expert of each tile (-1 past num_padded)
    num_padded_1: torch.Tensor  # int32 [1]: live slots
    block_m: int
    num_rows: int  # N: the sentinel and the number of routed rows
    p_max: int  # padded slots that can be live: N + min(E, N) * (block_m - 1)
    expert_start: int = 0
    num_experts: int = 1
    is_inline: bool = False  # decode: sorted_P holds ids_N and the GEMMs derive the schedule themselves

    def kernel_args(self) -> dict:
        return dict(INLINE=self.is_inline, N_PAD=max(16, triton.next_power_of_2(self.num_rows)) if self.is_inline else 16,
                    E_PAD=max(16, triton.next_power_of_2(self.num_experts)) if self.is_inline else 16)


MAX_INLINE_ROWS = 64  # up to this many routed rows, the GEMMs build the schedule in registers


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def block_schedule(ids_N: torch.Tensor, num_local_experts: int, expert_start: int, block_m: int,
                   allow_inline: bool = False) -> BlockSchedule:
    """Rows of local experts grouped by expert, each group padded to a multiple of block_m.

    allow_inline and N <= MAX_INLINE_ROWS: no launch; the GEMM programs derive the same schedule."""
    _check(ids_N.dim() == 1 and not ids_N.is_floating_point(), f"ids_N must be a 1-D integer tensor, got {ids_N.dtype} {tuple(ids_N.shape)}")
    _check(num_local_experts >= 1 and block_m >= 16 and block_m & (block_m - 1) == 0,
           f"bad schedule request: num_local_experts={num_local_experts} block_m={block_m}")
    N, E, dev = ids_N.numel(), num_local_experts, ids_N.device
    ids_N = ids_N.contiguous()
    p_max = N + min(E, N) * (block_m - 1)
    if allow_inline and 0 < N <= MAX_INLINE_ROWS:
        return BlockSchedule(ids_N, ids_N, ids_N, block_m, N, p_max, expert_start, E, True)
    num_tiles = triton.cdiv(p_max, block_m)
    sorted_P = torch.empty(max(p_max, 1), dtype=torch.int32, device=dev)
    expert_B = torch.empty(max(num_tiles, 1), dtype=torch.int32, device=dev)
    num_padded_1 = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = max(16, triton.next_power_of_2(E))
    n_pow = triton.next_power_of_2(max(N, 1))
    sub = min(64, max(16, n_pow))  # one-hot [sub, e_pad] and pairwise [sub, sub] per step
    chunk = max(sub, triton.next_power_of_2(triton.cdiv(N, 64)))  # at most 64 chunks, in parallel
    num_chunks = max(1, triton.cdiv(N, chunk))
    is_single = num_chunks == 1
    counts_CE = sorted_P if is_single else torch.empty(num_chunks, e_pad, dtype=torch.int32, device=dev)
    if not is_single:
        align_count_kernel[(num_chunks,)](ids_N, counts_CE, N, expert_start, E, CHUNK=chunk, SUB=sub, E_PAD=e_pad,
                                          num_warps=8)
    align_scatter_kernel[(num_chunks,)](
        ids_N, counts_CE, sorted_P, expert_B, num_padded_1, N, expert_start, E, num_chunks, num_tiles,
        BLOCK_M=block_m, CHUNK=chunk, SUB=sub, E_PAD=e_pad, C_PAD=max(2, triton.next_power_of_2(num_chunks)),
        TILE_SUB=min(64, 8192 // e_pad), IS_SINGLE=is_single, num_warps=8,
    )
    return BlockSchedule(sorted_P, expert_B, num_padded_1, block_m, N, p_max, expert_start, E)


def _check_weights(x: torch.Tensor, w: torch.Tensor, name: str, rows: int, cols: int) -> None:
    _check(x.dtype in _DTYPES, f"activations must be one of {_DTYPES}, got {x.dtype}")
    _check(w.dim() == 3 and w.shape[1] == rows and w.shape[2] == cols,
           f"{name} must be [E, {rows}, {cols}], got {tuple(w.shape)}")
    _check(w.dtype == x.dtype and w.device == x.device,
           f"{name} must match the activations ({x.dtype}, {x.device}), got ({w.dtype}, {w.device})")
    _check(w.stride(2) == 1 and x.stride(-1) == 1, f"{name} and the activations need a unit last stride")


def _dot_precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _can_use_tma(cfg: GemmConfig, *tensors: torch.Tensor) -> bool:
    """TMA needs a GPU, contiguous tensors and 16-byte aligned rows; otherwise the pointer path runs."""
    return (cfg.use_tma and not _is_interpreter() and all(
        t.is_cuda and t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in tensors))


def _descriptor(t2d: torch.Tensor, block_shape):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t2d, list(block_shape))


def gate_up(x_SD: torch.Tensor, w13_E2FD: torch.Tensor, sched: BlockSchedule, row_div: int, cfg: GemmConfig) -> torch.Tensor:
    """act_PF[p] = silu(x_SD[r // row_div] @ w1.T) * (x_SD[r // row_div] @ w3.T), r = sorted_P[p]."""
    _check(x_SD.dim() == 2, f"x must be 2-D, got {tuple(x_SD.shape)}")
    E, F2, D = w13_E2FD.shape
    _check(F2 % 2 == 0, f"w13_E2FD dim 1 must be 2F (gate; up), got {F2}")
    F = F2 // 2
    _check_weights(x_SD, w13_E2FD, "w13_E2FD", F2, x_SD.shape[1])
    p_max = max(sched.p_max, 1)
    act_PF = torch.empty(p_max, F, dtype=x_SD.dtype, device=x_SD.device)
    num_tiles_m = triton.cdiv(p_max, sched.block_m)
    grid = (num_tiles_m * triton.cdiv(F, cfg.block_n),)
    use_tma = _can_use_tma(cfg, w13_E2FD)
    w13 = _descriptor(w13_E2FD.view(E * F2, D), (cfg.block_n, cfg.block_k)) if use_tma else w13_E2FD
    gate_up_kernel[grid](
        x_SD, w13, act_PF, sched.sorted_P, sched.expert_B, sched.num_padded_1,
        sched.num_rows, row_div, D, F, num_tiles_m, sched.expert_start, sched.num_experts,
        x_SD.stride(0), w13_E2FD.stride(0), w13_E2FD.stride(1), w13_E2FD.stride(2), act_PF.stride(0),
        BLOCK_M=sched.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        IS_FP32_DOT=_is_interpreter(), USE_TMA=use_tma, DOT_PRECISION=_dot_precision(x_SD),
        **sched.kernel_args(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return act_PF


def down(act_PF: torch.Tensor, w2_EDF: torch.Tensor, weights_N: torch.Tensor, sched: BlockSchedule,
         cfg: GemmConfig, y_ND: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y_ND[r] = weights_N[r] * act_PF[p] @ w2_e.T for r = sorted_P[p]; other rows untouched."""
    E, D, F = w2_EDF.shape
    _check_weights(act_PF, w2_EDF, "w2_EDF", D, act_PF.shape[1])
    _check(weights_N.numel() == sched.num_rows and weights_N.device == act_PF.device,
           f"weights must hold one entry per routed row ({sched.num_rows}), got {tuple(weights_N.shape)}")
    if y_ND is None:
        y_ND = torch.empty(sched.num_rows, D, dtype=act_PF.dtype, device=act_PF.device)
    _check(y_ND.shape == (sched.num_rows, D) and y_ND.stride(1) == 1, f"bad output {tuple(y_ND.shape)}")
    num_tiles_m = triton.cdiv(act_PF.shape[0], sched.block_m)
    grid = (num_tiles_m * triton.cdiv(D, cfg.block_n),)
    use_tma = _can_use_tma(cfg, w2_EDF, act_PF)
    act, w2 = act_PF, w2_EDF
    if use_tma:
        act = _descriptor(act_PF, (sched.block_m, cfg.block_k))
        w2 = _descriptor(w2_EDF.view(E * D, F), (cfg.block_n, cfg.block_k))
    down_kernel[grid](
        act, w2, y_ND, weights_N.contiguous(), sched.sorted_P, sched.expert_B, sched.num_padded_1,
        sched.num_rows, D, F, num_tiles_m, sched.expert_start, sched.num_experts,
        act_PF.stride(0), w2_EDF.stride(0), w2_EDF.stride(1), w2_EDF.stride(2), y_ND.stride(0),
        BLOCK_M=sched.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        IS_FP32_DOT=_is_interpreter(), USE_TMA=use_tma, DOT_PRECISION=_dot_precision(act_PF),
        **sched.kernel_args(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y_ND


def combine_topk(y_ND: torch.Tensor, ids_TK: torch.Tensor, num_local_experts: int, expert_start: int) -> torch.Tensor:
    """out_TD[t] = sum over local k of y_ND[t*K + k] (rows of other experts are never read)."""
    T, K = ids_TK.shape
    _check(y_ND.dim() == 2 and y_ND.shape[0] == T * K and y_ND.stride(1) == 1,
           f"y_ND must be [T*K={T * K}, D], got {tuple(y_ND.shape)}")
    D = y_ND.shape[1]
    out_TD = torch.empty(T, D, dtype=y_ND.dtype, device=y_ND.device)
    block_d = min(1024, triton.next_power_of_2(D))
    if T:
        combine_kernel[(T, triton.cdiv(D, block_d))](
            y_ND, ids_TK.contiguous(), out_TD, D, expert_start, num_local_experts, y_ND.stride(0), out_TD.stride(0),
            K=K, BLOCK_D=block_d, num_warps=4,
        )
    return out_TD


def fused_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor, expert_start: int = 0,
                  config: Optional[FusedMoEConfig] = None) -> torch.Tensor:
    """The whole expert path: routed rows of x_TD through SwiGLU experts, weighted, summed per token.

    w13_E2FD/w2_EDF hold the E local experts [expert_start, expert_start + E); rows routed elsewhere
    (or dropped, id -1) add nothing.
    """
    _check(x_TD.dim() == 2 and topk_ids_TK.dim() == 2 and topk_ids_TK.shape == topk_weights_TK.shape
           and topk_ids_TK.shape[0] == x_TD.shape[0],
           f"x_TD {tuple(x_TD.shape)}, topk_ids_TK {tuple(topk_ids_TK.shape)} and topk_weights_TK "
           f"{tuple(topk_weights_TK.shape)} disagree")
    _check(x_TD.device == topk_ids_TK.device == topk_weights_TK.device, "inputs on different devices")
    T, K = topk_ids_TK.shape
    E, F2, D = w13_E2FD.shape
    if T == 0:
        return torch.empty_like(x_TD)
    cfg = config or get_config(T, E, F2 // 2, D, K, _DTYPE_NAMES[x_TD.dtype])
    sched = block_schedule(topk_ids_TK.reshape(-1), E, expert_start, cfg.block_m, allow_inline=True)
    act_PF = gate_up(x_TD, w13_E2FD, sched, K, cfg.gate_up)
    y_ND = down(act_PF, w2_EDF, topk_weights_TK.reshape(-1), sched, cfg.down)
    return combine_topk(y_ND, topk_ids_TK, E, expert_start)
