"""Local token dispatcher: groups routed rows by expert and scatters expert outputs back.

Design: `dispatch` returns the rows this rank computes, sorted by local expert, and a frozen
`DispatchMetadata` that `combine` consumes; nothing else carries state between the two. The local
dispatcher (EP = 1, or one rank's view of its own experts) is the base class; the all-to-all
dispatchers of `moe_infer.parallel` subclass it. Every routed row keeps a slot (R = N = T*K), so
the shapes never depend on the routing and no host sync is needed: rows of dropped (id -1) or
non-local experts sort behind the local ones and experts must leave their outputs zero.

Legend: T tokens, D hidden, E local experts, K top-k, N = T*K routed rows, R dispatched rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moe_infer.routing.permute import permute_rows


@dataclass(frozen=True)
class DispatchMetadata:
    num_tokens: int  # T
    top_k: int  # K
    token_idx_R: torch.Tensor  # int64 [R]: source token of each dispatched row
    weights_R: torch.Tensor  # float32 [R]: routing weight of each row (0 for dropped rows)
    counts_E: torch.Tensor  # int64 [E]: rows per local expert
    offsets_E1: torch.Tensor  # int64 [E+1]: rows of local expert e are [offsets[e], offsets[e+1])
    inv_N: torch.Tensor  # int64 [N]: dispatched row of routed row n = t*K + k


class LocalDispatcher:
    """All experts `[expert_start, expert_start + num_local_experts)` are computed on this rank."""

    def __init__(
        self, num_experts: int, num_local_experts: int | None = None, expert_start: int = 0,
        permute_backend: str = "auto",
    ) -> None:
        self.num_experts = num_experts
        self.num_local_experts = num_experts if num_local_experts is None else num_local_experts
        self.expert_start = expert_start
        # logical expert held in each local slot (EP placements with replicas need not be contiguous)
        self.local_expert_ids = list(range(expert_start, expert_start + self.num_local_experts))
        self.permute_backend = permute_backend  # PERMUTE_BACKENDS name; "auto": Triton on CUDA, torch on CPU

    def for_layer(self, layer_idx: int) -> "LocalDispatcher":
        """The dispatcher of one MoE layer (this one: a local dispatcher has no per-layer state)."""
        return self

    def sort_rows(self, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_tokens: int) -> DispatchMetadata:
        perm = permute_rows(
            topk_ids_TK, topk_weights_TK, self.num_local_experts, self.expert_start, backend=self.permute_backend
        )
        return DispatchMetadata(
            num_tokens=num_tokens, top_k=topk_ids_TK.shape[1], token_idx_R=perm.token_idx_R,
            weights_R=perm.weights_R, counts_E=perm.counts_E, offsets_E1=perm.offsets_E1, inv_N=perm.inv_N,
        )

    def dispatch(
        self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, DispatchMetadata]:
        meta = self.sort_rows(topk_ids_TK, topk_weights_TK, x_TD.shape[0])
        return x_TD.index_select(0, meta.token_idx_R), meta

    def combine(self, y_RD: torch.Tensor, meta: DispatchMetadata) -> torch.Tensor:
        """y_RD holds weighted expert outputs (zero for rows not computed here) -> out_TD."""
        y_TKD = y_RD.index_select(0, meta.inv_N).view(meta.num_tokens, meta.top_k, y_RD.shape[1])  # T may be 0
        return y_TKD.sum(dim=1, dtype=torch.float32).to(y_RD.dtype)

    def forward_experts(
        self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
        experts_fn: Callable[[torch.Tensor, DispatchMetadata], torch.Tensor],
        fused_fn: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """dispatch -> experts_fn(x_RD, meta) -> combine; EP dispatchers override it to overlap the
        all-to-alls with the expert compute. fused_fn(x_RD, ids_R1, weights_R1) -> weighted y_RD, if
        the experts backend has one, computes rows in any order (ids: local expert, -1 = skip); EP
        dispatchers run it on the received buffer as it lies; this dispatcher does not need it."""
        x_RD, meta = self.dispatch(x_TD, topk_ids_TK, topk_weights_TK)
        return self.combine(experts_fn(x_RD, meta), meta)
