"""The three steps the capacity policies are built from, as a swappable backend (PyTorch reference
here; Triton in `triton_capacity`). Every backend computes exactly the same integers.

Legend: T tokens, E experts, K top-k, N = T*K routed rows (n = t*K + k).
*Visiting order*: the priority in which rows claim capacity, a permutation order_N of the rows
(None = routed-row order n, i.e. token order as DeepSpeed's `topkgating`). A row's *rank* is the
number of rows of the same expert visited before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from moe_infer.registry import Registry


@dataclass(frozen=True)
class CapacityOps:
    # (ids_TK, E, order_N | None) -> (rank_N int64, -1 for invalid ids; counts_E int64)
    expert_ranks: Callable[[torch.Tensor, int, Optional[torch.Tensor]], Tuple[torch.Tensor, torch.Tensor]]
    # (ids_TK, weights_TK, rank_N, capacity, renormalize) -> (kept ids_TK int32 (-1 dropped), weights_TK fp32)
    drop_rows: Callable[..., Tuple[torch.Tensor, torch.Tensor]]
    # (kept_ids_TK, topk_ids_TK, choice_TE, counts_E, order_N | None, capacity) -> rerouted ids_TK int32
    reroute_rows: Callable[..., torch.Tensor]


CAPACITY_KERNELS: Registry[CapacityOps] = Registry("capacity kernels")


def expert_ranks_torch(
    ids_TK: torch.Tensor, num_experts: int, order_N: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    ids_N = ids_TK.reshape(-1).long()
    N, E = ids_N.numel(), num_experts
    visit_V = ids_N if order_N is None else ids_N[order_N]  # id of the row visited at position v
    key_V = torch.where((visit_V >= 0) & (visit_V < E), visit_V, torch.full_like(visit_V, E))
    key_S, perm_S = torch.sort(key_V, stable=True)  # perm_S: visiting position of sorted slot s
    counts_E1 = torch.zeros(E + 1, dtype=torch.int64, device=ids_N.device).scatter_add_(0, key_V, torch.ones_like(key_V))
    start_E1 = torch.cumsum(counts_E1, 0) - counts_E1
    rank_V = torch.empty(N, dtype=torch.int64, device=ids_N.device)
    rank_V[perm_S] = torch.arange(N, device=ids_N.device) - start_E1[key_S]
    rank_V = torch.where(key_V < E, rank_V, torch.full_like(rank_V, -1))
    rank_N = rank_V if order_N is None else torch.empty_like(rank_V).index_put_((order_N,), rank_V)
    return rank_N, counts_E1[:E]


def drop_rows_torch(
    ids_TK: torch.Tensor, weights_TK: torch.Tensor, rank_N: torch.Tensor, capacity: int, renormalize: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows ranked >= capacity get id -1, weight 0; with `renormalize` the kept weights are scaled so
    that each token's total is unchanged (its kept weights are renormalised among themselves)."""
    keep_TK = (rank_N.view(ids_TK.shape) < capacity) & (ids_TK >= 0)
    kept_ids_TK = torch.where(keep_TK, ids_TK.to(torch.int32), torch.full_like(ids_TK, -1, dtype=torch.int32))
    w_TK = weights_TK.float()
    kept_w_TK = torch.where(keep_TK, w_TK, torch.zeros_like(w_TK))
    if renormalize:
        kept_T1 = kept_w_TK.sum(-1, keepdim=True)
        scale_T1 = torch.where(kept_T1 > 0, w_TK.sum(-1, keepdim=True) / kept_T1.clamp_min(1e-30), 0.0)
        kept_w_TK = kept_w_TK * scale_T1
    return kept_ids_TK, kept_w_TK


def reroute_rows_torch(
    kept_ids_TK: torch.Tensor, topk_ids_TK: torch.Tensor, choice_TE: torch.Tensor, counts_E: torch.Tensor,
    order_N: Optional[torch.Tensor], capacity: int,
) -> torch.Tensor:
    """Dropped rows, in visiting order, move to their token's best-scoring expert (ties: lowest id) that
    the token does not use yet and that still has room after the kept rows and earlier moves; a row
    with no such expert stays dropped. Reference: a host loop over the dropped rows."""
    T, K = kept_ids_TK.shape
    E = choice_TE.shape[1]
    ids = kept_ids_TK.to(torch.int32).clone().cpu()
    room_E = (capacity - counts_E.cpu().clamp_max(capacity)).tolist()
    order = range(T * K) if order_N is None else order_N.cpu().tolist()
    dropped = ((topk_ids_TK.reshape(-1).cpu() >= 0) & (ids.reshape(-1) < 0)).tolist()
    choice = choice_TE.float().cpu()
    for n in order:
        if not dropped[n]:
            continue
        t = n // K
        used = set(ids[t].tolist())
        cands = [e for e in range(E) if room_E[e] > 0 and e not in used]
        if not cands:
            continue
        best = max(cands, key=lambda e: (float(choice[t, e]), -e))
        room_E[best] -= 1
        ids[t, n % K] = best
    return ids.to(kept_ids_TK.device)


CAPACITY_KERNELS.register("torch")(CapacityOps(expert_ranks_torch, drop_rows_torch, reroute_rows_torch))
