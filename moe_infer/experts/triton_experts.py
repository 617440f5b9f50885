"""Triton experts backend: EXPERT_BACKENDS["triton"], the fused MoE kernels on dispatched rows.

The layer hands already-gathered rows x_RD sorted by local expert (meta.offsets_E1); this backend
turns the offsets into the kernels' block-padded schedule on the device (no host sync), runs the
gate_up and down GEMMs and leaves rows past offsets_E1[-1] zero, as the contract asks (the path
of the expert-parallel dispatchers, which hand over already-gathered rows).

The backend also declares `fused_experts` (moe_infer.kernels.fused_moe.fused_experts): the whole
path from (x_TD, topk_ids, topk_weights) to out_TD, rows gathered inside the gate_up GEMM and
combined by one kernel, with no dispatch/combine of the dispatcher. MoELayer takes it when its
dispatcher is the plain LocalDispatcher.

Legend: R dispatched rows, D hidden, F expert intermediate, E local experts.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import triton

from moe_infer.experts.activation import ExpertExtras
from moe_infer.experts.local_dispatch import DispatchMetadata
from moe_infer.experts.reference import EXPERT_BACKENDS, experts_torch
from moe_infer.kernels.fused_moe import block_schedule, down, fused_experts, gate_up, launch_config, launch_variant
from moe_infer.kernels.fused_moe_schedule import auto_schedule_backend
from moe_infer.kernels.moe_epilogue import Epilogue

logger = logging.getLogger(__name__)
_warned: set = set()


def expert_of_rows(offsets_E1: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int32 [R]: local expert of each sorted row, E for rows past offsets_E1[-1]."""
    rows_R = torch.arange(num_rows, device=offsets_E1.device, dtype=offsets_E1.dtype)
    return torch.searchsorted(offsets_E1[1:].contiguous(), rows_R, right=True).to(torch.int32)


@EXPERT_BACKENDS.register("triton")
def experts_triton(
    x_RD: torch.Tensor, meta: DispatchMetadata, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor,
    extras: Optional[ExpertExtras] = None,
) -> torch.Tensor:
    # rows an all-to-all dispatcher gathered of quantized experts (each dequantized for the call), or experts with
    # biases / another activation (GPT-OSS), which the kernels do not apply: the reference loop
    if getattr(w13_E2FD, "quant", None) is not None or extras is not None:
        return experts_torch(x_RD, meta, w13_E2FD, w2_EDF, extras)
    R = x_RD.shape[0]
    E = w13_E2FD.shape[0]
    y_RD = torch.zeros_like(x_RD)
    if R == 0:
        return y_RD
    cfg = launch_config(meta.num_tokens, meta.top_k, w13_E2FD)
    sched = block_schedule(expert_of_rows(meta.offsets_E1, R), E, 0, cfg.block_m)
    act_PF = gate_up(x_RD, w13_E2FD, sched, 1, cfg.gate_up)
    return down(act_PF, w2_EDF, meta.weights_R, sched, cfg.down, y_RD)


def _has_fp8_dot(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def epilogue_of(extras: Optional[ExpertExtras]) -> Optional[Epilogue]:
    """The fused kernels' epilogue (moe_infer/kernels/moe_epilogue.py) of an expert call's extras (None: plain)."""
    if extras is None:
        return None
    return Epilogue(extras.act.kind == "clamped_swiglu", extras.act.alpha, extras.act.limit, extras.b13_E2F,
                    extras.b2_ED)


def fused_experts_any(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                      w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor, expert_start: int = 0,
                      extras: Optional[ExpertExtras] = None) -> torch.Tensor:
    """`fused_experts`, or for experts that carry a format (moe_infer/quant.py): fp8 block-scaled, the W8A8 grouped
    GEMMs of `moe_infer.kernels.fused_moe_fp8` (W8A16 below compute capability 8.9: the weights dequantized per call,
    warned once); int4 / mxfp4, the W4A16 kernels of `moe_infer.kernels.fused_moe_w4a16` (ids outside the local
    experts [expert_start, expert_start + E) skipped). extras (biases, GPT-OSS's clamped SwiGLU): applied in the
    bf16 and W4A16 kernels' epilogues; the fp8 kernels do not take them."""
    q13, q2 = getattr(w13_E2FD, "quant", None), getattr(w2_EDF, "quant", None)
    epilogue = epilogue_of(extras)
    if q13 is None:
        return fused_experts(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, w2_EDF, expert_start, epilogue=epilogue)
    if q13.fmt in ("int4", "mxfp4"):
        from moe_infer.kernels.fused_moe_w4a16 import fused_moe_int4, fused_moe_mxfp4

        if q13.fmt == "int4":
            return fused_moe_int4(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, q13.scale, w2_EDF, q2.scale,
                                  q13.group_size, q13.zero, q2.zero, expert_start, epilogue=epilogue)
        return fused_moe_mxfp4(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, q13.scale, w2_EDF, q2.scale, expert_start,
                               epilogue=epilogue)
    if q13.fmt != "fp8_block":
        raise NotImplementedError(f"experts of format {q13.fmt!r} have no fused kernel")
    if epilogue is not None:
        raise NotImplementedError("fp8 experts with biases or another activation than SiLU have no fused kernel")
    if not _has_fp8_dot(x_TD.device):  # W8A16: no fp8 tensor cores
        if x_TD.device not in _warned:
            _warned.add(x_TD.device)
            logger.warning("fp8 experts on %s (compute capability below 8.9): weights dequantized per call (W8A16)",
                           x_TD.device)
        return fused_experts(x_TD, topk_ids_TK, topk_weights_TK, q13.dequantize(w13_E2FD, x_TD.dtype),
                             q2.dequantize(w2_EDF, x_TD.dtype), expert_start)
    from moe_infer.kernels.fused_moe_fp8 import fused_moe_fp8

    E = w13_E2FD.shape[0]
    local_TK = topk_ids_TK  # the kernels skip ids outside [0, E): only a shifted range needs its ids moved (3 launches)
    if expert_start:
        local_TK = topk_ids_TK.to(torch.int64) - expert_start
        local_TK = torch.where((local_TK >= 0) & (local_TK < E), local_TK, -1).to(topk_ids_TK.dtype)
    return fused_moe_fp8(x_TD, local_TK, topk_weights_TK, w13_E2FD, q13.scale_inv, w2_EDF, q2.scale_inv,
                         q13.block_n, q13.block_k)


def launch_variant_any(num_tokens: int, top_k: int, w13_E2FD: torch.Tensor):
    """`launch_variant`; fp8 experts: their token count's power of two (what the dense fp8 GEMMs' tiles follow) and
    their tiles (tuned or `moe_tiles`; the matrix-vector kernels at one token); 4-bit
    experts: their config, schedule backend and the specialised row counts."""
    q = getattr(w13_E2FD, "quant", None)
    if q is None:
        return launch_variant(num_tokens, top_k, w13_E2FD)
    if q.fmt in ("int4", "mxfp4"):
        from moe_infer.kernels.fused_moe_w4a16 import format_name, w4_config

        E, F2 = w13_E2FD.shape[:2]
        D = w13_E2FD.shape[2] * (8 if q.fmt == "int4" else 2)
        name = format_name(q.fmt, getattr(q, "group_size", 32), getattr(q, "zero", None) is not None)
        cfg = w4_config(num_tokens, E, F2 // 2, D, top_k, name)
        N = num_tokens * top_k
        tiles_m = triton.cdiv(max(N + min(E, N) * (cfg.block_m - 1), 1), cfg.block_m)
        backend = auto_schedule_backend(N, E, True) if cfg.schedule == "auto" else cfg.schedule
        n_pad = max(16, triton.next_power_of_2(N)) if backend == "inline" else 16
        return (name, cfg, backend, n_pad, tuple((n == 1, n % 16 == 0) for n in (N, tiles_m)))
    from moe_infer.kernels.fp8_expert_gemv import MAX_TOKENS
    from moe_infer.kernels.fused_moe_fp8 import fp8_tiles

    E, F2, D = w13_E2FD.shape
    tiles = "gemv" if num_tokens <= MAX_TOKENS else fp8_tiles(num_tokens, E, F2 // 2, D, top_k, q.block_n, q.block_k)
    return ("fp8", max(num_tokens * top_k - 1, 0).bit_length(), tiles)


experts_triton.fused_experts = fused_experts_any
experts_triton.fused_extras_formats = (None, "int4", "mxfp4")  # ... with biases / the clamped SwiGLU (None: bf16)
experts_triton.launch_config = launch_config
experts_triton.launch_variant = launch_variant_any  # which kernel variants a step of T tokens runs (engine warm-up)
