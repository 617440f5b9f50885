"""The W4A16 fused MoE: 4-bit expert weights (int4 group-wise, GPTQ / compressed-tensors "pack-quantized"; mxfp4,
GPT-OSS's OCP microscaling), 16-bit activations, the weights dequantized in registers (kernels in
fused_moe_w4a16_kernels.py, formats in w4_format.py, references of the same signatures in w4_ref.py).

    fused_moe_int4(x_TD, topk_ids_TK, topk_weights_TK, w13_packed, w13_scale, w2_packed, w2_scale, group,
                   w13_zero=None, w2_zero=None, expert_start=0, config=None, epilogue=None) -> out_TD
    fused_moe_mxfp4(x_TD, topk_ids_TK, topk_weights_TK, w13_packed, w13_scale, w2_packed, w2_scale,
                    expert_start=0, config=None, epilogue=None) -> out_TD
      = block_schedule (the bf16 path's: inline for decode, align / permute kernels otherwise)
      -> gate_up_w4_kernel -> down_w4_kernel -> combine_topk (fused_moe.py)

Weights: w13 [E, 2F, D] (gate rows, then up rows) and w2 [E, D, F] as their formats store them (packed along the
reduction dim); ids outside the local experts [expert_start, expert_start + E) and -1 add nothing. epilogue
(moe_epilogue.py): expert biases and GPT-OSS's clamped SwiGLU (GPT-OSS's mxfp4 experts run here).
Launch config: `w4_config` (a tuned JSON file of fused_moe_config.py named by the format, e.g. dtype=int4_g128,
else the bf16 shape heuristic); only its block sizes, group_m, warps and stages apply (no TMA / persistent variant).
No host sync: grids from shapes, so a decode step captures in a CUDA graph.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k, N = T*K routed rows, P padded slots.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import triton

from moe_infer.kernels.fused_moe import combine_topk
from moe_infer.kernels.fused_moe_config import FusedMoEConfig, device_name, get_config, load_configs
from moe_infer.kernels.fused_moe_schedule import block_schedule
from moe_infer.kernels.fused_moe_w4a16_kernels import down_w4_kernel, gate_up_w4_kernel, w4a16_gemm_kernel
from moe_infer.kernels.moe_epilogue import Epilogue
from moe_infer.kernels.w4_format import INT4_PER_WORD, MXFP4_GROUP, SCALE_DTYPES

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FORMATS = {"int4": 0, "mxfp4": 1}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def format_name(fmt: str, group: int, has_zero: bool = False) -> str:
    """The dtype field of a tuned config file: int4_g128 (symmetric), int4_g128_zp, mxfp4."""
    return "mxfp4" if fmt == "mxfp4" else f"int4_g{group}" + ("_zp" if has_zero else "")


W4_MAX_STAGES = 2  # the bf16 heuristic's 3-4 stages overflow an H200's 227 KB of shared memory (241,664 bytes asked)


def w4_config(num_tokens: int, E: int, F: int, D: int, top_k: int, fmt_name: str) -> FusedMoEConfig:
    """The tuned config of this shape, format and device (configs/E=..,F=..,D=..,dtype=<fmt_name>,device=..json),
    else the bf16 shape heuristic (logged once) with at most W4_MAX_STAGES pipeline stages: the 4-bit kernels stage
    their dequantized tiles too, and the heuristic's stages did not fit an H200's shared memory."""
    if load_configs(E, F, D, fmt_name, device_name()):
        return get_config(num_tokens, E, F, D, top_k, fmt_name)
    cfg = get_config(num_tokens, E, F, D, top_k, fmt_name)
    return dataclasses.replace(
        cfg, gate_up=dataclasses.replace(cfg.gate_up, num_stages=min(cfg.gate_up.num_stages, W4_MAX_STAGES)),
        down=dataclasses.replace(cfg.down, num_stages=min(cfg.down.num_stages, W4_MAX_STAGES)))


def _check_weight(name: str, w: torch.Tensor, s: torch.Tensor, z: Optional[torch.Tensor], fmt: str, group: int,
                  E: int, N: int, K: int, device: torch.device) -> None:
    per = INT4_PER_WORD if fmt == "int4" else 2
    want_dtype = torch.int32 if fmt == "int4" else torch.uint8
    _check(w.dtype == want_dtype and tuple(w.shape) == (E, N, K // per),
           f"{name} ({fmt}) must be {want_dtype} [{E}, {N}, {K // per}], got {w.dtype} {tuple(w.shape)}")
    want_s = (E, N, K // group)
    s_dtypes = SCALE_DTYPES if fmt == "int4" else (torch.uint8,)
    _check(s.dtype in s_dtypes and tuple(s.shape) == want_s,
           f"{name}'s scale must be one of {s_dtypes} {list(want_s)}, got {s.dtype} {tuple(s.shape)}")
    if z is not None:
        _check(z.dtype == torch.uint8 and tuple(z.shape) == want_s,
               f"{name}'s zero points must be uint8 {list(want_s)}, got {z.dtype} {tuple(z.shape)}")
    for t in (w, s) + ((z,) if z is not None else ()):
        _check(t.device == device, f"{name} and its scales must be on {device}, got {t.device}")
        _check(t.stride(2) == 1, f"{name}'s tensors need a unit last stride, got {tuple(t.stride())}")
    if z is not None:
        _check(z.stride() == s.stride(), f"{name}'s zero points must be laid out as its scales")


def fused_moe_w4a16(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, fmt: str,
                    w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, group: int,
                    w13_zero: Optional[torch.Tensor] = None, w2_zero: Optional[torch.Tensor] = None,
                    expert_start: int = 0, config: Optional[FusedMoEConfig] = None,
                    epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    """Both formats: fmt "int4" or "mxfp4" (group 32)."""
    _check(fmt in FORMATS, f"unknown 4-bit format {fmt!r}: one of {sorted(FORMATS)}")
    _check(x_TD.dim() == 2 and topk_ids_TK.dim() == 2 and topk_ids_TK.shape == topk_weights_TK.shape
           and topk_ids_TK.shape[0] == x_TD.shape[0],
           f"x_TD {tuple(x_TD.shape)}, topk_ids_TK {tuple(topk_ids_TK.shape)} and topk_weights_TK "
           f"{tuple(topk_weights_TK.shape)} disagree")
    _check(x_TD.dtype in ACT_DTYPES, f"activations must be one of {ACT_DTYPES}, got {x_TD.dtype}")
    _check(x_TD.stride(-1) == 1, "activations need a unit last stride")
    _check(x_TD.is_cuda or _is_interpreter(), f"the Triton kernels need CUDA tensors or TRITON_INTERPRET=1, got "
           f"{x_TD.device}")
    _check((w13_zero is None) == (w2_zero is None), "give zero points for both w13 and w2, or for neither")
    _check(fmt == "int4" or (group == MXFP4_GROUP and w13_zero is None), f"mxfp4 has groups of {MXFP4_GROUP} and no "
           f"zero points")
    T, D = x_TD.shape
    E, F2 = w13.shape[:2]
    F = F2 // 2
    _check(F2 % 2 == 0 and group % (INT4_PER_WORD if fmt == "int4" else 2) == 0 and D % group == 0
           and F % group == 0, f"group {group} must divide D={D} and F={F} (and be a multiple of the packing)")
    _check_weight("w13", w13, w13_scale, w13_zero, fmt, group, E, 2 * F, D, x_TD.device)
    _check_weight("w2", w2, w2_scale, w2_zero, fmt, group, E, D, F, x_TD.device)
    epilogue = epilogue or Epilogue()
    epilogue.check(E, 2 * F, D, x_TD.device)
    for name, t in (("topk_ids", topk_ids_TK), ("topk_weights", topk_weights_TK)):
        _check(t.device == x_TD.device, f"{name} is on {t.device}, x on {x_TD.device}")
    if T == 0:
        return torch.empty_like(x_TD)
    K = topk_ids_TK.shape[1]
    cfg = config or w4_config(T, E, F, D, K, format_name(fmt, group, w13_zero is not None))
    ids_TK = topk_ids_TK.contiguous()
    weights_N = topk_weights_TK.reshape(-1).contiguous()
    sched = block_schedule(ids_TK.view(-1), E, expert_start, cfg.block_m, allow_inline=True, backend=cfg.schedule,
                           weights_N=weights_N)
    p_max = max(sched.p_max, 1)
    num_tiles_m = triton.cdiv(p_max, sched.block_m)
    common = dict(FMT=FORMATS[fmt], GROUP=group, HAS_ZERO=w13_zero is not None, BLOCK_M=sched.block_m,
                  IS_FP32_DOT=_is_interpreter() or x_TD.dtype == torch.float32, **sched.kernel_args())
    act_PF = torch.empty(p_max, F, dtype=x_TD.dtype, device=x_TD.device)
    gu = cfg.gate_up
    gate_up_w4_kernel[(num_tiles_m * triton.cdiv(F, gu.block_n),)](
        x_TD, w13, w13_scale, w13_zero if w13_zero is not None else w13_scale, act_PF,
        sched.sorted_P, sched.expert_B, sched.num_padded_1, sched.num_rows, K, D, F, num_tiles_m, expert_start, E,
        x_TD.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act_PF.stride(0),
        BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, GROUP_M=gu.group_m, num_warps=gu.num_warps,
        num_stages=gu.num_stages, **common, **epilogue.gate_up_args(act_PF),
    )
    y_ND = torch.empty(sched.num_rows, D, dtype=x_TD.dtype, device=x_TD.device)  # non-local rows: never read
    dn = cfg.down
    down_w4_kernel[(num_tiles_m * triton.cdiv(D, dn.block_n),)](
        act_PF, w2, w2_scale, w2_zero if w2_zero is not None else w2_scale, y_ND, weights_N,
        sched.sorted_P, sched.expert_B, sched.num_padded_1, sched.num_rows, D, F, num_tiles_m, expert_start, E,
        act_PF.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y_ND.stride(0),
        BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, GROUP_M=dn.group_m, num_warps=dn.num_warps,
        num_stages=dn.num_stages, **common, **epilogue.down_args(y_ND),
    )
    return combine_topk(y_ND, ids_TK, E, expert_start)


def fused_moe_int4(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                   w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
                   group: int, w13_zero: Optional[torch.Tensor] = None, w2_zero: Optional[torch.Tensor] = None,
                   expert_start: int = 0, config: Optional[FusedMoEConfig] = None,
                   epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    """int4 group-wise experts: packed int32 [E, N, K / 8], scales [E, N, K / group], zeros uint8 or None (8)."""
    return fused_moe_w4a16(x_TD, topk_ids_TK, topk_weights_TK, "int4", w13_packed, w13_scale, w2_packed, w2_scale,
                           group, w13_zero, w2_zero, expert_start, config, epilogue)


def fused_moe_mxfp4(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
                    expert_start: int = 0, config: Optional[FusedMoEConfig] = None,
                    epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    """mxfp4 experts: packed uint8 [E, N, K / 2], e8m0 scales uint8 [E, N, K / 32]."""
    return fused_moe_w4a16(x_TD, topk_ids_TK, topk_weights_TK, "mxfp4", w13_packed, w13_scale, w2_packed, w2_scale,
                           MXFP4_GROUP, None, None, expert_start, config, epilogue)


def w4a16_gemm(x_MK: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor, group: int,
               zero: Optional[torch.Tensor] = None, fmt: str = "int4") -> torch.Tensor:
    """y_MN = x_MK @ w^T in x's dtype for one 4-bit weight [N, K] (a dense layer; the formats of the experts').
    Tiles: 16 rows for decode sizes, 64 beyond; 64 columns, 64-deep K (or the group, if smaller)."""
    _check(fmt in FORMATS, f"unknown 4-bit format {fmt!r}: one of {sorted(FORMATS)}")
    _check(x_MK.dim() == 2 and x_MK.dtype in ACT_DTYPES and x_MK.stride(1) == 1,
           f"x must be a 2-D {ACT_DTYPES} tensor with a unit last stride, got {x_MK.dtype} {tuple(x_MK.shape)}")
    _check(x_MK.is_cuda or _is_interpreter(), f"the Triton kernels need CUDA tensors or TRITON_INTERPRET=1, got "
           f"{x_MK.device}")
    M, K = x_MK.shape
    N = w_packed.shape[0]
    _check(K % group == 0, f"K={K} must be a multiple of the group {group}")
    _check_weight("w", w_packed[None], scale[None], None if zero is None else zero[None], fmt, group, 1, N, K,
                  x_MK.device)
    y_MN = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0:
        return y_MN
    block_m = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, 64))
    w4a16_gemm_kernel[grid](
        x_MK, w_packed, scale, zero if zero is not None else scale, y_MN, M, N, K, x_MK.stride(0),
        w_packed.stride(0), scale.stride(0), y_MN.stride(0), FMT=FORMATS[fmt], GROUP=group,
        HAS_ZERO=zero is not None, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
        IS_FP32_DOT=_is_interpreter() or x_MK.dtype == torch.float32, num_warps=4, num_stages=3,
    )
    return y_MN
