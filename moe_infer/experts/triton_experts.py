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

from typing import Optional

import torch

from moe_infer.experts.activation import ExpertExtras
from moe_infer.experts.local_dispatch import DispatchMetadata
from moe_infer.experts.reference import EXPERT_BACKENDS, experts_torch
from moe_infer.quant import FP8
from moe_infer.kernels.fused_moe import block_schedule, down, fused_experts, gate_up, launch_config, launch_variant


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


def fused_experts_any(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                      w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """`fused_experts`, or for fp8 block-scaled experts (moe_infer/quant.py) the W8A8 grouped GEMMs of
    `moe_infer.kernels.fused_moe_fp8` (ids outside the local experts [expert_start, expert_start + E) skipped)."""
    if w13_E2FD.dtype != FP8:
        return fused_experts(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD, w2_EDF, expert_start)
    from moe_infer.kernels.fused_moe_fp8 import fused_moe_fp8

    E = w13_E2FD.shape[0]
    local_TK = topk_ids_TK.to(torch.int64) - expert_start
    local_TK = torch.where((local_TK >= 0) & (local_TK < E), local_TK, -1).to(topk_ids_TK.dtype)
    q13, q2 = w13_E2FD.quant, w2_EDF.quant
    return fused_moe_fp8(x_TD, local_TK, topk_weights_TK, w13_E2FD, q13.scale_inv, w2_EDF, q2.scale_inv,
                         q13.block_n, q13.block_k)


def launch_variant_any(num_tokens: int, top_k: int, w13_E2FD: torch.Tensor):
    """`launch_variant`; fp8 experts: their token count's power of two (what their kernels' tiles follow)."""
    if w13_E2FD.dtype == FP8:
        return ("fp8", max(num_tokens * top_k - 1, 0).bit_length())
    return launch_variant(num_tokens, top_k, w13_E2FD)


experts_triton.fused_experts = fused_experts_any
experts_triton.launch_config = launch_config
experts_triton.launch_variant = launch_variant_any  # which kernel variants a step of T tokens runs (engine warm-up)
