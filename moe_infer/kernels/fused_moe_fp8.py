"""The block-scaled FP8 (W8A8) fused MoE: DeepSeek-V3 / Qwen3 FP8 experts (fp8 e4m3 weights, one float32
scale per block_n x block_k block), in the spirit of vLLM's fused_moe with use_fp8_w8a8 and block_shape.

    fused_moe_fp8(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD_fp8, w13_scale, w2_EDF_fp8, w2_scale,
                  block_n, block_k, config=None) -> out_TD
    fp8_tiles(num_tokens, E, F, D, K, block_n, block_k) -> MoETiles   the tuned tiles, else `moe_tiles`
    fp8_config_name(block_n, block_k) -> str                          the dtype field of a tuned config file

One token (no config given): the two matrix-vector kernels of fp8_expert_gemv.py. Otherwise the tile path
      = block_schedule (routed rows sorted by expert into BLOCK_M-padded tiles; fused_moe_schedule.py)
      -> per_token_group_quant_fp8(x_TD, block_k)                     (fp8_gemm.py: once a token, not a row)
      -> gate_up_fp8_kernel: W8A8 gate and up, act = silu(gate) * up, act quantized per (slot, group)
      -> down_fp8_kernel: W8A8 down, times the routing weight, float32 rows y_ND
      -> combine_kernel (fused_moe_gemm.py): out_TD[t] = sum of t's rows (ids of -1 skipped), x's dtype

Scales: w13_scale [E, ceil(2F / block_n), D / block_k], w2_scale [E, ceil(D / block_n), F / block_k].
D and F must be multiples of block_k (the activations are quantized per group of block_k), block_k a power
of two; the rows of a scale block need not divide 2F or D. No host sync: every grid is sized from shapes
(P_max = N + min(E, N) * (BLOCK_M - 1) padded slots), so a step captures in a CUDA graph.
Reference of the same signature: fp8_ref.fused_moe_fp8_ref.

Tiles: configs/E=..,F=..,D=..,dtype=fp8_w8a8,device=..json (128 x 128 blocks; dtype=fp8_w8a8_<bn>x<bk> for
others), written by `scripts/tune_fused_moe.py --format fp8_w8a8`, the bf16 files' FusedMoEConfig per token count
(nearest wins): block_m, gate_up's warps / stages / group_m (its column tile is always block_k), down's column tile,
warps, stages. Without a file: `moe_tiles`, logged once.

Legend: T tokens, D hidden, F expert intermediate, E experts, K top-k, N = T*K routed rows, P padded
slots, Gd = D / block_k and Gf = F / block_k scale groups.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from moe_infer.kernels.fp8_gemm import ACT_DTYPES, check_device, dot_upcast, is_interpreter, per_token_group_quant_fp8
from moe_infer.kernels.fp8_expert_gemv import fp8_expert_gemv, use_fp8_expert_gemv
from moe_infer.kernels.fp8_ref import FP8_DTYPE, FP8_MAX, SCALE_EPS, check_block_scale
from moe_infer.kernels.fused_moe_fp8_kernels import down_fp8_kernel, gate_up_fp8_kernel
from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig, device_name, get_config, load_configs
from moe_infer.kernels.fused_moe_gemm import combine_kernel
from moe_infer.kernels.fused_moe_schedule import block_schedule

logger = logging.getLogger(__name__)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class MoETiles:
    block_m: int
    block_n_down: int = 128  # gate_up's column tile is block_k (one intermediate scale group a tile)
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    down_warps: Optional[int] = None  # down's, where they differ from gate_up's
    down_stages: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n_down"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoETiles.{name} must be a power of two >= 16, got {v}")

    def to_config(self, block_k: int) -> FusedMoEConfig:
        """As a tuned file stores it (fused_moe_config.FusedMoEConfig)."""
        return FusedMoEConfig(self.block_m, GemmConfig(block_k, block_k, self.group_m, self.num_warps, self.num_stages),
                              GemmConfig(self.block_n_down, block_k, self.group_m, self.down_warps or self.num_warps,
                                         self.down_stages or self.num_stages))

    @staticmethod
    def from_config(cfg: FusedMoEConfig) -> "MoETiles":
        return MoETiles(cfg.block_m, cfg.down.block_n, cfg.gate_up.group_m, cfg.gate_up.num_warps,
                        cfg.gate_up.num_stages, cfg.down.num_warps, cfg.down.num_stages)


def fp8_config_name(block_n: int, block_k: int) -> str:
    return "fp8_w8a8" if (block_n, block_k) == (128, 128) else f"fp8_w8a8_{block_n}x{block_k}"


_warned: set = set()


def fp8_tiles(num_tokens: int, E: int, F: int, D: int, K: int, block_n: int, block_k: int) -> MoETiles:
    """The tuned tiles of this shape, block size and device at the nearest tuned token count, else `moe_tiles`
    (logged once a shape). A file entry whose K tile is not block_k (edited by hand) is refused by name."""
    name, device = fp8_config_name(block_n, block_k), device_name()
    if load_configs(E, F, D, name, device):
        cfg = get_config(num_tokens, E, F, D, K, name, device)
        if cfg.gate_up.block_k != block_k or cfg.gate_up.block_n != block_k or cfg.down.block_k != block_k:
            raise ValueError(f"tuned fp8 config {name} for E={E},F={F},D={D}: K and gate_up column tiles must be "
                             f"block_k={block_k}, got {cfg}")
        return MoETiles.from_config(cfg)
    key = (E, F, D, name, device)
    if key not in _warned:
        _warned.add(key)
        logger.warning("no tuned fp8 fused MoE config E=%d,F=%d,D=%d,dtype=%s,device=%s; using moe_tiles", *key)
    return moe_tiles(num_tokens * K, E)


def moe_tiles(num_rows: int, num_experts: int) -> MoETiles:
    """Rows an expert gets on average: up to 16 (decode), 16-row tiles; up to 512, 64; then 128 (8 warps).
    Untuned: a rule in the spirit of vLLM's fp8 block defaults."""
    per_expert = triton.cdiv(num_rows, max(num_experts, 1))
    if per_expert <= 16:
        return MoETiles(16, 64)
    if per_expert <= 512:
        return MoETiles(64)
    return MoETiles(128, num_warps=8)


def _check_inputs(x_TD, topk_ids_TK, topk_weights_TK, w13, w13_scale, w2, w2_scale, block_n, block_k) -> None:
    _check(x_TD.dim() == 2 and topk_ids_TK.dim() == 2 and topk_ids_TK.shape == topk_weights_TK.shape
           and topk_ids_TK.shape[0] == x_TD.shape[0],
           f"x_TD {tuple(x_TD.shape)}, topk_ids_TK {tuple(topk_ids_TK.shape)} and topk_weights_TK "
           f"{tuple(topk_weights_TK.shape)} disagree")
    _check(x_TD.dtype in ACT_DTYPES, f"x must be one of {ACT_DTYPES}, got {x_TD.dtype}")
    _check(not topk_ids_TK.is_floating_point() and topk_weights_TK.is_floating_point(),
           f"topk_ids must be integers and topk_weights floats, got {topk_ids_TK.dtype}, {topk_weights_TK.dtype}")
    _check(w13.dim() == 3 and w2.dim() == 3, f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be 3-D")
    E, D, F = w2.shape
    _check(tuple(w13.shape) == (E, 2 * F, D) and x_TD.shape[1] == D,
           f"w13 must be [E, 2F, D] = [{E}, {2 * F}, {D}] and x [T, {D}], got {tuple(w13.shape)}, {tuple(x_TD.shape)}")
    check_block_scale(w13, w13_scale, block_n, block_k, "w13")
    check_block_scale(w2, w2_scale, block_n, block_k, "w2")
    _check(block_k & (block_k - 1) == 0 and D % block_k == 0 and F % block_k == 0,
           f"block_k ({block_k}) must be a power of two dividing D ({D}) and F ({F})")
    _check(x_TD.stride(1) == 1 or D <= 1, f"x needs a unit stride along D, got strides {tuple(x_TD.stride())}")
    _check(w13.stride(2) == 1 and w2.stride(2) == 1 and w13_scale.stride(2) == 1 and w2_scale.stride(2) == 1,
           "weights and scales need a unit last stride")
    for name, t in (("topk_ids", topk_ids_TK), ("topk_weights", topk_weights_TK), ("w13", w13), ("w2", w2)):
        _check(t.device == x_TD.device, f"{name} is on {t.device}, x on {x_TD.device}")
    check_device(x_TD)


def fused_moe_fp8(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  w13_E2FD_fp8: torch.Tensor, w13_scale: torch.Tensor, w2_EDF_fp8: torch.Tensor,
                  w2_scale: torch.Tensor, block_n: int, block_k: int,
                  config: Optional[MoETiles] = None) -> torch.Tensor:
    """out_TD[t] = sum_k topk_weights[t, k] * expert_e(x_t), e = topk_ids[t, k] (-1: nothing), every expert
    W8A8 SwiGLU: w13 holds gate rows [0, F) then up rows [F, 2F). Output in x's dtype. config: the tile path with
    these tiles (default: one token through fp8_expert_gemv, else `fp8_tiles`)."""
    _check_inputs(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD_fp8, w13_scale, w2_EDF_fp8, w2_scale, block_n, block_k)
    (T, K), (E, D, F) = topk_ids_TK.shape, w2_EDF_fp8.shape
    if config is None and use_fp8_expert_gemv(x_TD, T):
        return fp8_expert_gemv(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD_fp8, w13_scale, w2_EDF_fp8, w2_scale,
                               block_n, block_k)
    out_TD = torch.empty(T, D, dtype=x_TD.dtype, device=x_TD.device)
    if T == 0 or K == 0:
        return out_TD.zero_()
    N, dev = T * K, x_TD.device
    tiles = config or fp8_tiles(T, E, F, D, K, block_n, block_k)
    ids_TK = topk_ids_TK.contiguous()
    sched = block_schedule(ids_TK.view(N), E, 0, tiles.block_m, allow_inline=False)
    x_fp8, x_scale_TG = per_token_group_quant_fp8(x_TD, block_k)

    p_max = max(sched.p_max, 1)
    num_tiles_m = triton.cdiv(p_max, tiles.block_m)
    act_PF = torch.empty(num_tiles_m * tiles.block_m, F, dtype=FP8_DTYPE, device=dev)
    act_scale_PG = torch.empty(act_PF.shape[0], F // block_k, dtype=torch.float32, device=dev)
    upcast = dot_upcast(x_TD, block_k)
    common = dict(SCALE_BLOCK_N=block_n, BLOCK_M=tiles.block_m, BLOCK_K=block_k, GROUP_M=tiles.group_m,
                  DOT_UPCAST=upcast)
    gate_up_fp8_kernel[(num_tiles_m * (F // block_k),)](
        x_fp8, x_scale_TG, w13_E2FD_fp8, w13_scale, act_PF, act_scale_PG,
        sched.sorted_P, sched.expert_B, sched.num_padded_1, N, K, D, F, num_tiles_m, E,
        x_fp8.stride(0), x_scale_TG.stride(0), w13_E2FD_fp8.stride(0), w13_E2FD_fp8.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), act_PF.stride(0), act_scale_PG.stride(0),
        BLOCK_N=block_k, FP8_MAX=FP8_MAX, SCALE_EPS=SCALE_EPS, EXACT_RNE=is_interpreter(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **common,
    )
    y_ND = torch.empty(N, D, dtype=torch.float32, device=dev)  # rows of dropped ids stay unwritten, unread
    weights_N = topk_weights_TK.reshape(N).contiguous()
    down_fp8_kernel[(num_tiles_m * triton.cdiv(D, tiles.block_n_down),)](
        act_PF, act_scale_PG, w2_EDF_fp8, w2_scale, y_ND, weights_N,
        sched.sorted_P, sched.expert_B, sched.num_padded_1, N, D, F, num_tiles_m, E,
        act_PF.stride(0), act_scale_PG.stride(0), w2_EDF_fp8.stride(0), w2_EDF_fp8.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), y_ND.stride(0),
        BLOCK_N=tiles.block_n_down, num_warps=tiles.down_warps or tiles.num_warps,
        num_stages=tiles.down_stages or tiles.num_stages, **common,
    )
    block_d = min(1024, triton.next_power_of_2(D))
    combine_kernel[(T, triton.cdiv(D, block_d))](
        y_ND, ids_TK, out_TD, D, 0, E, y_ND.stride(0), out_TD.stride(0), K=K, BLOCK_D=block_d,
        USE_PDL=False, num_warps=4,
    )
    return out_TD
