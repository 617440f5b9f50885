"""Reference SwiGLU experts: one GEMM pair per local expert over its contiguous rows.

Legend: R dispatched rows, D hidden, F expert intermediate, E local experts.
Weights are stacked: w13_E2FD = [gate (w1); up (w3)] along dim 1, w2_EDF the down projection.
Output rows are multiplied by their routing weight; rows past offsets_E1[-1] stay zero.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moe_infer.experts.local_dispatch import DispatchMetadata
from moe_infer.quant import expert_weight
from moe_infer.registry import Registry

ExpertsFn = Callable[[torch.Tensor, DispatchMetadata, torch.Tensor, torch.Tensor], torch.Tensor]
EXPERT_BACKENDS: Registry[ExpertsFn] = Registry("experts backend")


@EXPERT_BACKENDS.register("torch")
def experts_torch(
    x_RD: torch.Tensor, meta: DispatchMetadata, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor
) -> torch.Tensor:
    y_RD = torch.zeros_like(x_RD)
    offsets = meta.offsets_E1.tolist()  # the reference path's one host sync per layer
    for e in range(w13_E2FD.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        if start == end:
            continue
        # quantized weights (moe_infer/quant.py): this expert's dequantized for the call (W8A16)
        h_rF2 = x_RD[start:end] @ expert_weight(w13_E2FD, e, x_RD.dtype).t()
        F_ = h_rF2.shape[1] // 2
        a_rF = F.silu(h_rF2[:, :F_]) * h_rF2[:, F_:]
        y_rD = a_rF @ expert_weight(w2_EDF, e, x_RD.dtype).t()
        y_RD[start:end] = y_rD * meta.weights_R[start:end, None].to(y_rD.dtype)
    return y_RD
