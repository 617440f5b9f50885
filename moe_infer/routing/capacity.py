"""Capacity policies: what happens to routed rows over an expert's capacity.

A policy maps (topk_ids_TK, topk_weights_TK, logits_TE=..., spec=..., **kwargs) to new
(topk_ids_TK int32, topk_weights_TK float32) where a dropped row has id -1 and weight 0; the token
still flows through the residual. Legend: T tokens, E experts, K top-k, N = T*K routed rows.

- `dropless` (default) keeps every row.
- `drop`: capacity = max(ceil(capacity_factor * T * K / E), min_capacity) rows per expert, computed in
  exact arithmetic with capacity_factor read as the decimal it is written as (1.1 is 11/10, not the
  binary double just above it): cf=1.1, T=25, K=2, E=5 gives 11. DeepSpeed evaluates the product in
  float32 and can land one above or below at such exact-integer boundaries; we follow the exact value. Which
  rows stay is decided by the visiting order (`capacity_ops`): `drop_by="position"` visits rows in
  token order (DeepSpeed `topkgating(drop_policy="position")`), or, with `position_order="slot"`,
  all first choices before all second choices (DeepSpeed `top2gating`, GShard); `drop_by="score"`
  keeps each expert's highest-scoring rows (DeepSpeed `drop_policy="probs"`; score = the router's
  softmax/sigmoid probability, ties by position). With `spec.renormalize` a token's kept weights
  are rescaled to its original total (DeepSpeed always renormalises the kept gates).
- `reroute`: like `drop`, then each dropped row, in the same order, moves to its token's next-best
  expert (score + optional `bias_E`) that the token does not use and that still has room, else it
  is dropped. Weights are the router scores of the final experts, renormalised per the spec, times
  `routed_scaling_factor`. Group limits (n_group) are not applied to the reroute targets.
The counting runs through `CAPACITY_KERNELS` ("auto": Triton on CUDA); no host sync on that path.
"""
from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import Callable, Optional, Tuple

import torch

from moe_infer.registry import Registry
from moe_infer.routing.backends import resolve_backend
from moe_infer.routing.capacity_ops import CAPACITY_KERNELS, CapacityOps
from moe_infer.routing.spec import RoutingSpec

PolicyFn = Callable[..., Tuple[torch.Tensor, torch.Tensor]]
CAPACITY_POLICIES: Registry[PolicyFn] = Registry("capacity policy")
DROP_BY = ("position", "score")
POSITION_ORDERS = ("token", "slot")


@lru_cache(maxsize=4096)
def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """capacity = max(ceil(capacity_factor * T * K / E), min_capacity), exact (a host int: T is a shape).

    capacity_factor counts as the shortest decimal that round-trips to it (`repr`), so the boundary
    falls where the written number puts it, not where float rounding of the product does."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    if min_capacity < 0:
        raise ValueError(f"min_capacity must be >= 0, got {min_capacity}")
    cf = Fraction(repr(float(capacity_factor)))
    return max(math.ceil(cf * num_tokens * top_k / num_experts), min_capacity)


def router_scores(logits_TE: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """float32 [T, E]: the router's probabilities (softmax or sigmoid of the logits)."""
    logits_TE = logits_TE.float()
    return torch.softmax(logits_TE, -1) if spec.scoring == "softmax" else torch.sigmoid(logits_TE)


def visiting_order(
    topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, scores_TE: Optional[torch.Tensor],
    drop_by: str, position_order: str,
) -> Optional[torch.Tensor]:
    """int64 [N] order in which rows claim capacity (None = routed-row order)."""
    if drop_by not in DROP_BY:
        raise ValueError(f"drop_by must be one of {DROP_BY}, got {drop_by!r}")
    if position_order not in POSITION_ORDERS:
        raise ValueError(f"position_order must be one of {POSITION_ORDERS}, got {position_order!r}")
    T, K = topk_ids_TK.shape
    if drop_by == "score":
        score_TK = topk_weights_TK.float() if scores_TE is None else scores_TE.gather(1, topk_ids_TK.long().clamp_min(0))
        return torch.sort(score_TK.reshape(-1), descending=True, stable=True)[1]
    if position_order == "slot":
        return torch.arange(T * K, device=topk_ids_TK.device).view(T, K).t().reshape(-1)
    return None


def _check(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, spec: Optional[RoutingSpec]) -> RoutingSpec:
    if spec is None:
        raise ValueError("capacity policies need the routing spec (spec=...)")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape != topk_weights_TK.shape:
        raise ValueError(f"ids {tuple(topk_ids_TK.shape)} / weights {tuple(topk_weights_TK.shape)} must be equal [T, K]")
    if topk_ids_TK.shape[1] != spec.top_k:
        raise ValueError(f"ids have K={topk_ids_TK.shape[1]}, the routing spec says top_k={spec.top_k}")
    return spec


def _ops(device: torch.device, backend: str) -> CapacityOps:
    return CAPACITY_KERNELS.get(resolve_backend(CAPACITY_KERNELS, backend, device))


@CAPACITY_POLICIES.register("dropless")
def dropless(
    topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, scores_TE: Optional[torch.Tensor] = None, **_: object,
) -> Tuple[torch.Tensor, torch.Tensor]:
    return topk_ids_TK, topk_weights_TK


@CAPACITY_POLICIES.register("drop")
def drop(
    topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, logits_TE: Optional[torch.Tensor] = None,
    spec: Optional[RoutingSpec] = None, capacity_factor: float = 1.0, min_capacity: int = 4,
    drop_by: str = "position", position_order: str = "token", backend: str = "auto", **_: object,
) -> Tuple[torch.Tensor, torch.Tensor]:
    spec = _check(topk_ids_TK, topk_weights_TK, spec)
    T, K = topk_ids_TK.shape
    capacity = expert_capacity(T, K, spec.num_experts, capacity_factor, min_capacity)
    scores_TE = None if logits_TE is None or drop_by != "score" else router_scores(logits_TE, spec)
    order_N = visiting_order(topk_ids_TK, topk_weights_TK, scores_TE, drop_by, position_order)
    ops = _ops(topk_ids_TK.device, backend)
    rank_N, _ = ops.expert_ranks(topk_ids_TK, spec.num_experts, order_N)
    return ops.drop_rows(topk_ids_TK, topk_weights_TK, rank_N, capacity, spec.renormalize)


@CAPACITY_POLICIES.register("reroute")
def reroute(
    topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, logits_TE: Optional[torch.Tensor] = None,
    spec: Optional[RoutingSpec] = None, capacity_factor: float = 1.0, min_capacity: int = 4,
    drop_by: str = "position", position_order: str = "token", backend: str = "auto",
    bias_E: Optional[torch.Tensor] = None, **_: object,
) -> Tuple[torch.Tensor, torch.Tensor]:
    spec = _check(topk_ids_TK, topk_weights_TK, spec)
    if logits_TE is None:
        raise ValueError("the reroute policy needs the router logits (logits_TE=...) to rank other experts")
    T, K = topk_ids_TK.shape
    capacity = expert_capacity(T, K, spec.num_experts, capacity_factor, min_capacity)
    scores_TE = router_scores(logits_TE, spec)
    order_N = visiting_order(topk_ids_TK, topk_weights_TK, scores_TE, drop_by, position_order)
    ops = _ops(topk_ids_TK.device, backend)
    rank_N, counts_E = ops.expert_ranks(topk_ids_TK, spec.num_experts, order_N)
    kept_ids_TK, _ = ops.drop_rows(topk_ids_TK, topk_weights_TK, rank_N, capacity, False)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    ids_TK = ops.reroute_rows(kept_ids_TK, topk_ids_TK, choice_TE, counts_E, order_N, capacity)
    w_TK = torch.where(ids_TK >= 0, scores_TE.gather(1, ids_TK.long().clamp_min(0)), torch.zeros((), device=ids_TK.device))
    if spec.renormalize:
        w_TK = w_TK / w_TK.sum(-1, keepdim=True).clamp_min(1e-20)
    return ids_TK, w_TK * spec.routed_scaling_factor
