"""Capacity policies: what happens to routed rows over an expert's capacity.

A policy maps (topk_ids_TK, topk_weights_TK, scores) to new (topk_ids_TK, topk_weights_TK) where a
dropped row has id -1 and weight 0. `dropless` keeps every row and is the default.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from moe_infer.registry import Registry

PolicyFn = Callable[..., Tuple[torch.Tensor, torch.Tensor]]
CAPACITY_POLICIES: Registry[PolicyFn] = Registry("capacity policy")


@CAPACITY_POLICIES.register("dropless")
def dropless(
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    scores_TE: Optional[torch.Tensor] = None,
    **_: object,
) -> Tuple[torch.Tensor, torch.Tensor]:
    return topk_ids_TK, topk_weights_TK
