"""PyTorch references of the W4A16 fused MoE (fused_moe_w4a16.py), same signatures: the 4-bit weights dequantized
(w4_format.py) to the activations' dtype, as the kernels do in registers, then the plain MoE of fused_moe_ref.py
(per expert, float32 sums, one cast at the end). For tests.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_infer.kernels.fused_moe_ref import fused_experts_ref
from moe_infer.kernels.moe_epilogue import Epilogue
from moe_infer.kernels.w4_format import MXFP4_GROUP, dequantize_int4, dequantize_mxfp4


def fused_moe_int4_ref(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                       w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                       w2_scale: torch.Tensor, group: int, w13_zero: Optional[torch.Tensor] = None,
                       w2_zero: Optional[torch.Tensor] = None, expert_start: int = 0, config=None,
                       epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    w13 = dequantize_int4(w13_packed, w13_scale, w13_zero, group, x_TD.dtype)
    w2 = dequantize_int4(w2_packed, w2_scale, w2_zero, group, x_TD.dtype)
    return fused_experts_ref(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, expert_start, epilogue=epilogue)


def fused_moe_mxfp4_ref(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                        w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                        w2_scale: torch.Tensor, expert_start: int = 0, config=None,
                        epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    assert w13_scale.shape[-1] * MXFP4_GROUP == w13_packed.shape[-1] * 2
    w13 = dequantize_mxfp4(w13_packed, w13_scale, x_TD.dtype)
    w2 = dequantize_mxfp4(w2_packed, w2_scale, x_TD.dtype)
    return fused_experts_ref(x_TD, topk_ids_TK, topk_weights_TK, w13, w2, expert_start, epilogue=epilogue)
