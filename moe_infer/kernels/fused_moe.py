"""Launch wrappers of the fused MoE path (kernels in fused_moe_align.py and fused_moe_gemm.py).

    fused_experts(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, w2_EDF) -> out_TD
        = block_schedule (fused_moe_schedule.py: no launch for decode, the GEMMs derive it)
      -> gate_up -> down -> combine (COMBINE_MODES: "kernel" = combine_topk after down,
                                     "tail" = inside the down GEMM's epilogue)

A one-token step without an explicit config takes expert_gemv.py's two matrix-vector kernels instead
(gate_up, then down with the combine inside).

No host sync: every grid is sized from shapes alone (P_max = N + min(E, N) * (BLOCK_M - 1) padded
slots bound the schedule), so a decode step captures in a CUDA graph. Each function has a PyTorch
reference of the same signature in fused_moe_ref.py.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k, N = T*K routed rows,
P padded slots, B tiles.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton

from moe_infer.kernels.expert_gemv import expert_gemv, use_expert_gemv
from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig, get_config
from moe_infer.kernels.fused_moe_gemm import combine_kernel, down_kernel, gate_up_kernel
from moe_infer.kernels.moe_epilogue import Epilogue, is_plain
from moe_infer.kernels.fused_moe_persistent import down_persistent_kernel, gate_up_persistent_kernel
from moe_infer.kernels.fused_moe_schedule import (  # noqa: F401  (re-exported)
    MAX_INLINE_ROWS, SCHEDULE_BACKENDS, BlockSchedule, block_schedule, use_pdl,
)
from moe_infer.kernels.sm_count import num_sms
from moe_infer.registry import Registry

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


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


def _num_programs(cfg: GemmConfig, sched: BlockSchedule, num_tiles: int, device: torch.device) -> int:
    """Programs of a persistent GEMM (cfg.persistent, not with the inline schedule): one per SM, at most one
    per tile; 0 for the one-program-per-tile kernels."""
    if not cfg.persistent or sched.is_inline:
        return 0
    return max(1, min(num_sms(device) if device.type == "cuda" else 4, num_tiles))


def _tile_meta(sched: BlockSchedule, cfg: GemmConfig, use_tma: bool, t: torch.Tensor) -> dict:
    """The launch keywords both GEMM kernels share, persistent or not: tiles, dtypes, warps, stages, PDL."""
    return dict(BLOCK_M=sched.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                IS_FP32_DOT=_is_interpreter(), USE_TMA=use_tma, DOT_PRECISION=_dot_precision(t),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **use_pdl(t))


def gate_up(x_SD: torch.Tensor, w13_E2FD: torch.Tensor, sched: BlockSchedule, row_div: int, cfg: GemmConfig,
            epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    """act_PF[p] = silu(x_SD[r // row_div] @ w1.T) * (x_SD[r // row_div] @ w3.T), r = sorted_P[p]; an epilogue
    (moe_epilogue.py: gate/up bias, clamped SwiGLU) runs the per-tile kernel."""
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
    one_dot = use_tma and cfg.one_dot
    if one_dot:  # gate and up tiles of one expert in one box: [1, 2, BLOCK_N, BLOCK_K] over [E, 2, F, D]
        w13 = _descriptor(w13_E2FD.view(E, 2, F, D), (1, 2, cfg.block_n, cfg.block_k))
    else:
        w13 = _descriptor(w13_E2FD.view(E * F2, D), (cfg.block_n, cfg.block_k)) if use_tma else w13_E2FD
    num_programs = _num_programs(cfg, sched, grid[0], x_SD.device) if is_plain(epilogue) else 0
    if num_programs:
        gate_up_persistent_kernel[(num_programs,)](
            x_SD, w13, act_PF, sched.sorted_P, sched.expert_B, sched.num_padded_1,
            sched.num_rows, row_div, D, F,
            x_SD.stride(0), w13_E2FD.stride(0), w13_E2FD.stride(1), w13_E2FD.stride(2), act_PF.stride(0),
            NUM_PROGRAMS=num_programs, FLATTEN=cfg.flatten, ONE_DOT=one_dot, **_tile_meta(sched, cfg, use_tma, x_SD),
        )
        return act_PF
    gate_up_kernel[grid](
        x_SD, w13, act_PF, sched.sorted_P, sched.expert_B, sched.num_padded_1,
        sched.num_rows, row_div, D, F, num_tiles_m, sched.expert_start, sched.num_experts,
        x_SD.stride(0), w13_E2FD.stride(0), w13_E2FD.stride(1), w13_E2FD.stride(2), act_PF.stride(0),
        ONE_DOT=one_dot, **sched.kernel_args(), **_tile_meta(sched, cfg, use_tma, x_SD),
        **(epilogue or Epilogue()).gate_up_args(act_PF),
    )
    return act_PF


@dataclass(frozen=True)
class TailCombine:
    """The down GEMM also combines: out_TD[t] = sum of t's local y_ND rows (see `_combine_tail`)."""

    out_TD: torch.Tensor  # zeros on entry (tokens without a local row stay zero)
    ids_TK: torch.Tensor
    counts_TC: torch.Tensor  # int32 zeros [T, cdiv(D, block_n)]


def down(act_PF: torch.Tensor, w2_EDF: torch.Tensor, weights_N: torch.Tensor, sched: BlockSchedule,
         cfg: GemmConfig, y_ND: Optional[torch.Tensor] = None, tail: Optional[TailCombine] = None,
         epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    """y_ND[r] = weights_N[r] * act_PF[p] @ w2_e.T for r = sorted_P[p]; other rows untouched.
    With `tail`, also tail.out_TD = the top-k combine of y_ND (the rows of local experts). With an epilogue's down
    bias, weights_N[r] * (act_PF[p] @ w2_e.T + b2[e]) (the per-tile kernel)."""
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
    top_k = sched.num_rows // tail.ids_TK.shape[0] if tail is not None else 1
    if tail is not None:
        T = tail.ids_TK.shape[0]
        _check(tail.ids_TK.shape == (T, top_k) and T * top_k == sched.num_rows and tail.ids_TK.is_contiguous(),
               f"tail: ids_TK {tuple(tail.ids_TK.shape)} must be contiguous [T, K] with T*K = {sched.num_rows}")
        _check(tail.out_TD.shape == (T, D) and tail.out_TD.stride(1) == 1 and tail.out_TD.dtype == y_ND.dtype,
               f"tail: out_TD must be [{T}, {D}] {y_ND.dtype}, got {tuple(tail.out_TD.shape)} {tail.out_TD.dtype}")
        _check(tail.counts_TC.dtype == torch.int32 and tail.counts_TC.numel() >= T * triton.cdiv(D, cfg.block_n),
               f"tail: counts_TC must hold int32 [{T}, {triton.cdiv(D, cfg.block_n)}]")
    if use_tma:
        act = _descriptor(act_PF, (sched.block_m, cfg.block_k))
        w2 = _descriptor(w2_EDF.view(E * D, F), (cfg.block_n, cfg.block_k))
    num_programs = _num_programs(cfg, sched, grid[0], act_PF.device) if tail is None and is_plain(epilogue) else 0
    if num_programs:
        down_persistent_kernel[(num_programs,)](
            act, w2, y_ND, weights_N.contiguous(), sched.sorted_P, sched.expert_B, sched.num_padded_1,
            sched.num_rows, D, F,
            act_PF.stride(0), w2_EDF.stride(0), w2_EDF.stride(1), w2_EDF.stride(2), y_ND.stride(0),
            NUM_PROGRAMS=num_programs, FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize and use_tma,
            **_tile_meta(sched, cfg, use_tma, act_PF),
        )
        return y_ND
    down_kernel[grid](
        act, w2, y_ND, weights_N.contiguous(), sched.sorted_P, sched.expert_B, sched.num_padded_1,
        *((tail.out_TD, tail.ids_TK, tail.counts_TC) if tail is not None else (y_ND,) * 3),
        sched.num_rows, D, F, num_tiles_m, sched.expert_start, sched.num_experts,
        act_PF.stride(0), w2_EDF.stride(0), w2_EDF.stride(1), w2_EDF.stride(2), y_ND.stride(0),
        tail.out_TD.stride(0) if tail is not None else 0,
        COMBINE_TAIL=tail is not None, TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)),
        **sched.kernel_args(), **_tile_meta(sched, cfg, use_tma, act_PF), **(epilogue or Epilogue()).down_args(y_ND),
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
            K=K, BLOCK_D=block_d, num_warps=4, **use_pdl(y_ND),
        )
    return out_TD


CombineFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, BlockSchedule, GemmConfig, torch.Tensor], torch.Tensor]
COMBINE_MODES: Registry[CombineFn] = Registry("fused MoE combine mode")


@COMBINE_MODES.register("kernel")
def down_then_combine(act_PF, w2_EDF, weights_N, sched: BlockSchedule, cfg: GemmConfig, ids_TK,
                      epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    """down writes y_ND, one more kernel sums each token's K rows."""
    y_ND = down(act_PF, w2_EDF, weights_N, sched, cfg, epilogue=epilogue)
    return combine_topk(y_ND, ids_TK, sched.num_experts, sched.expert_start)


@COMBINE_MODES.register("tail")
def down_with_tail_combine(act_PF, w2_EDF, weights_N, sched: BlockSchedule, cfg: GemmConfig, ids_TK,
                           epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    """down sums each token's rows in its epilogue; out_TD and the counters share one zero fill."""
    (T, K), D = ids_TK.shape, w2_EDF.shape[1]
    num_tiles_n = triton.cdiv(D, cfg.block_n)
    out_bytes = -(-T * D * act_PF.element_size() // 16) * 16
    zeros = torch.zeros(out_bytes + T * num_tiles_n * 4, dtype=torch.uint8, device=act_PF.device)
    out_TD = zeros[:T * D * act_PF.element_size()].view(act_PF.dtype).view(T, D)
    counts_TC = zeros[out_bytes:].view(torch.int32).view(T, num_tiles_n)
    y_ND = torch.empty(T * K, D, dtype=act_PF.dtype, device=act_PF.device)
    down(act_PF, w2_EDF, weights_N, sched, cfg, y_ND, TailCombine(out_TD, ids_TK.contiguous(), counts_TC), epilogue)
    return out_TD


def launch_config(num_tokens: int, top_k: int, w13_E2FD: torch.Tensor) -> FusedMoEConfig:
    """The config (tuned for this shape and device, else the heuristic) the kernels run with at num_tokens
    tokens over these experts. With the schedule's block sizes, which follow powers of two of the routed
    rows, it selects which compiled variant of each kernel a step runs (the engine's start-up warm-up)."""
    E, F2, D = w13_E2FD.shape
    return get_config(num_tokens, E, F2 // 2, D, top_k, _DTYPE_NAMES[w13_E2FD.dtype])


def launch_variant(num_tokens: int, top_k: int, w13_E2FD: torch.Tensor) -> tuple:
    """`launch_config` and how Triton specializes the expert GEMMs' size arguments at num_tokens tokens
    (num_rows and num_tiles_m: equal to 1, divisible by 16; kept specialized, as the GEMMs measured slower
    without): what selects the compiled variants of the fused experts (the engine's start-up warm-up)."""
    cfg = launch_config(num_tokens, top_k, w13_E2FD)
    N, E = num_tokens * top_k, w13_E2FD.shape[0]
    tiles_m = triton.cdiv(max(N + min(E, N) * (cfg.block_m - 1), 1), cfg.block_m)  # block_schedule's p_max
    return cfg, tuple((n == 1, n % 16 == 0) for n in (N, tiles_m))


def fused_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor, expert_start: int = 0,
                  config: Optional[FusedMoEConfig] = None, epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    """The whole expert path: routed rows of x_TD through SwiGLU experts, weighted, summed per token.

    w13_E2FD/w2_EDF hold the E local experts [expert_start, expert_start + E); rows routed elsewhere
    (or dropped, id -1) add nothing. config (default: the tuned one for this shape and device)
    also names the schedule backend and the combine mode. Without a config, a one-token step takes
    the matrix-vector kernels of expert_gemv.py instead of the tile GEMMs. epilogue (moe_epilogue.py): expert
    biases and GPT-OSS's clamped SwiGLU, in the tile GEMMs' epilogues (the matrix-vector kernels and the persistent
    variants do not take one).
    """
    _check(x_TD.dim() == 2 and topk_ids_TK.dim() == 2 and topk_ids_TK.shape == topk_weights_TK.shape
           and topk_ids_TK.shape[0] == x_TD.shape[0],
           f"x_TD {tuple(x_TD.shape)}, topk_ids_TK {tuple(topk_ids_TK.shape)} and topk_weights_TK "
           f"{tuple(topk_weights_TK.shape)} disagree")
    _check(x_TD.device == topk_ids_TK.device == topk_weights_TK.device, "inputs on different devices")
    T, K = topk_ids_TK.shape
    E = w13_E2FD.shape[0]
    if T == 0:
        return torch.empty_like(x_TD)
    if epilogue is not None:
        epilogue.check(E, w13_E2FD.shape[1], w13_E2FD.shape[2], x_TD.device)
    if config is None and is_plain(epilogue) and use_expert_gemv(x_TD, T):
        return expert_gemv(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, w2_EDF, expert_start)
    cfg = config or launch_config(T, K, w13_E2FD)
    combine = COMBINE_MODES.get(cfg.combine)
    weights_N = topk_weights_TK.reshape(-1)
    sched = block_schedule(topk_ids_TK.reshape(-1), E, expert_start, cfg.block_m, allow_inline=True,
                           backend=cfg.schedule, weights_N=weights_N)
    act_PF = gate_up(x_TD, w13_E2FD, sched, K, cfg.gate_up, epilogue)
    return combine(act_PF, w2_EDF, weights_N, sched, cfg.down, topk_ids_TK, epilogue)
