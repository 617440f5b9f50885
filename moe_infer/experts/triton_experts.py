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

import torch

from moe_infer.experts.local_dispatch import DispatchMetadata
from moe_infer.experts.reference import EXPERT_BACKENDS
from moe_infer.kernels.fused_moe import block_schedule, down, fused_experts, gate_up, launch_config, launch_variant


def expert_of_rows(offsets_E1: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int32 [R]: local expert of each sorted row, E for rows past offsets_E1[-1]."""
    rows_R = torch.arange(num_rows, device=offsets_E1.device, dtype=offsets_E1.dtype)
    return torch.searchsorted(offsets_E1[1:].contiguous(), rows_R, right=True).to(torch.int32)


@EXPERT_BACKENDS.register("triton")
def experts_triton(
    x_RD: torch.Tensor, meta: DispatchMetadata, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor
) -> torch.Tensor:
    R = x_RD.shape[0]
    E = w13_E2FD.shape[0]
    y_RD = torch.zeros_like(x_RD)
    if R == 0:
        return y_RD
    cfg = launch_config(meta.num_tokens, meta.top_k, w13_E2FD)
    sched = block_schedule(expert_of_rows(meta.offsets_E1, R), E, 0, cfg.block_m)
    act_PF = gate_up(x_RD, w13_E2FD, sched, 1, cfg.gate_up)
    return down(act_PF, w2_EDF, meta.weights_R, sched, cfg.down, y_RD)


experts_triton.fused_experts = fused_experts
experts_triton.launch_config = launch_config
experts_triton.launch_variant = launch_variant  # which kernel variants a step of T tokens runs (engine warm-up)
