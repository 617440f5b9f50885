"""Expert selection: router logits -> (topk_weights_TK, topk_ids_TK). PyTorch reference backend.

Legend: T tokens, E experts, K top-k, G expert groups.
Ties break toward the lowest expert id (a stable descending sort), in every backend.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from moe_infer.registry import Registry
from moe_infer.routing.spec import RoutingSpec

SelectFn = Callable[[torch.Tensor, RoutingSpec, Optional[torch.Tensor]], Tuple[torch.Tensor, torch.Tensor]]
ROUTING_BACKENDS: Registry[SelectFn] = Registry("routing backend")


def _topk_stable(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


@ROUTING_BACKENDS.register("torch")
def select_experts_torch(
    logits_TE: torch.Tensor, spec: RoutingSpec, bias_E: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns topk_weights_TK (float32) and topk_ids_TK (int32)."""
    T, E = logits_TE.shape
    logits_TE = logits_TE.float()
    if spec.scoring == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    if spec.num_expert_group > 1:
        G = spec.num_expert_group
        choice_TGe = choice_TE.view(T, G, E // G)
        if bias_E is not None:  # DeepSeek-V3: a group's score is the sum of its top-2 experts
            group_TG = _topk_stable(choice_TGe, 2)[0].sum(-1)
        else:
            group_TG = choice_TGe.max(-1).values
        _, keep_group_idx = _topk_stable(group_TG, spec.topk_group)
        group_mask_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, keep_group_idx, True)
        mask_TE = group_mask_TG.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~mask_TE, float("-inf"))
    _, topk_ids_TK = _topk_stable(choice_TE, spec.top_k)
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if spec.renormalize:
        topk_weights_TK = topk_weights_TK / topk_weights_TK.sum(-1, keepdim=True).clamp_min(1e-20)
    if spec.routed_scaling_factor != 1.0:
        topk_weights_TK = topk_weights_TK * spec.routed_scaling_factor
    return topk_weights_TK, topk_ids_TK.to(torch.int32)
