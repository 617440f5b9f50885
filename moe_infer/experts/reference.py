"""Reference SwiGLU experts: one GEMM pair per local expert over its contiguous rows.

Legend: R dispatched rows, D hidden, F expert intermediate, E local experts.
Weights are stacked: w13_E2FD = [gate (w1); up (w3)] along dim 1, w2_EDF the down projection.
Output rows are multiplied by their routing weight; rows past offsets_E1[-1] stay zero.
`extras` (moe_infer/experts/activation.py): another activation (GPT-OSS's clamped SwiGLU) and biases; a backend
that cannot apply them falls back to this one.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from moe_infer.experts.activation import SILU, ExpertExtras
from moe_infer.experts.local_dispatch import DispatchMetadata
from moe_infer.quant import expert_weight
from moe_infer.registry import Registry

ExpertsFn = Callable[..., torch.Tensor]  # (x_RD, meta, w13_E2FD, w2_EDF, extras=None) -> y_RD
EXPERT_BACKENDS: Registry[ExpertsFn] = Registry("experts backend")


@EXPERT_BACKENDS.register("torch")
def experts_torch(
    x_RD: torch.Tensor, meta: DispatchMetadata, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor,
    extras: Optional[ExpertExtras] = None,
) -> torch.Tensor:
    y_RD = torch.zeros_like(x_RD)
    offsets = meta.offsets_E1.tolist()  # the reference path's one host sync per layer
    F_ = w13_E2FD.shape[1] // 2
    act = SILU if extras is None else extras.act
    b13_E2F = None if extras is None else extras.b13_E2F
    b2_ED = None if extras is None else extras.b2_ED
    for e in range(w13_E2FD.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        if start == end:
            continue
        # quantized weights (moe_infer/quant.py): this expert's dequantized for the call (W8A16, W4A16)
        h_rF2 = x_RD[start:end] @ expert_weight(w13_E2FD, e, x_RD.dtype).t()
        if b13_E2F is not None:
            h_rF2 = h_rF2 + b13_E2F[e].to(h_rF2.dtype)
        a_rF = act(h_rF2[:, :F_], h_rF2[:, F_:])
        y_rD = a_rF @ expert_weight(w2_EDF, e, x_RD.dtype).t()
        if b2_ED is not None:
            y_rD = y_rD + b2_ED[e].to(y_rD.dtype)
        y_RD[start:end] = y_rD * meta.weights_R[start:end, None].to(y_rD.dtype)
    return y_RD
