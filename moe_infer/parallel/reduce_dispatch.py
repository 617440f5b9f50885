"""The reduce dispatcher: where every EP rank holds the same tokens, no tokens move at all.

Design
------
In this engine attention is tensor parallel or replicated within a pipeline stage, so after attention
every rank of the stage holds the same T tokens and the same routing (`tokens_replicated`). Then each
rank can run its own experts on the rows of all T tokens routed to them, and one all-reduce over the
stage sums the ranks' partial outputs into every token's full MoE output, as vLLM does for expert
parallelism without attention data parallelism. Per layer and rank, for T tokens of D values (top-k K,
ep ranks, a ring all-reduce):

    all-to-all (exact / capacity / fixed)   dispatch + combine of T/ep tokens' K rows each, then an
                                            all-gather of the T/ep outputs: about (2K/ep + 1)(ep-1)/ep * T*D
                                            values sent; three collectives
    reduce (this one)                       one all-reduce of T*D: 2 (ep-1)/ep * T*D values; one collective,
                                            merged with the tensor-parallel all-reduce of the shared expert

So with replicated tokens it sends fewer bytes at every T (K = 8, ep = 2: 4.5x fewer), in one collective
instead of three, with no host sync and shapes that never depend on the routing: a decode step under a
mesh is one CUDA graph with it. Every routed row is computed (dropless, exact). The expert compute per
rank is the same as with an all-to-all: the rows routed to its experts.

Which rank computes a row: the rank holding the row's expert; with redundant replicas (a placement file
or online re-balancing), replica n mod M of expert e for routed row n = t*K + k (M: e's replicas; t counted
within the token chunk when the step is overlapped, below). Every rank applies the same rule, so each row
is computed exactly once. The table behind it (`owner_EM`: local slot on this rank of each (expert,
replica), -1 elsewhere) is one device tensor of a fixed shape, rewritten in place when the placement
changes (`set_placement`), so captured graphs stay valid.

The dispatcher returns this rank's partial sum (`returns_partial`); the MoE layer all-reduces it over the
pipeline stage, together with the shared expert's partial sum where those are the same ranks.

Overlap. On a large step the one all-reduce waits for all experts and the next layer waits for it. With
`overlap` and an all-reduce payload (T*D elements) of at least `overlap_min_mb`, the layer splits its T
tokens, routed once, into `overlap_micro_batches` contiguous chunks (`micro_batches` says how many): it
runs the experts of chunk m on the compute stream while the all-reduce of chunk m-1 is on the wire
(NCCL's stream on GPU, gloo's thread on CPU), as vLLM's dual-batch / SGLang's two-batch overlap do, and
waits for all at the end: one all-reduce per chunk instead of one per layer. Decode steps (small T, and
any step captured in a CUDA graph) keep the single all-reduce. The threshold is the one measured for the
all-to-all dispatchers' payload (config.py); the token split has no GPU measurement of its own yet.

Legend: T tokens, D hidden, E logical experts, S local slots, M replicas per expert (bound), K top-k,
N = T*K routed rows.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.parallel.all_to_all import DISPATCHERS, A2ADispatcher, ExpertsCall, FusedCall
from moe_infer.parallel.placement import ExpertPlacement


def _graph_capturing() -> bool:
    """Whether a CUDA graph is being captured on this thread's stream (decode graphs keep one all-reduce)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def owner_table(placement: ExpertPlacement, rank: int, max_replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner_EM int32 [E, max_replicas]: the local slot on `rank` of replica j of expert e, -1 where that
    replica lives elsewhere (or does not exist); num_replicas_E int64 [E]). Replicas in physical-slot order."""
    S, E = placement.slots_per_rank, placement.num_experts
    owner_EM = torch.full((E, max_replicas), -1, dtype=torch.int32)
    num_rep_E = torch.zeros(E, dtype=torch.int64)
    for p, e in enumerate(placement.phys_to_logical()):
        j = int(num_rep_E[e])
        if j >= max_replicas:
            raise ValueError(f"expert {e} has more than {max_replicas} replicas: the placement has {placement.num_physical} "
                             f"slots for {E} experts")
        if p // S == rank:
            owner_EM[e, j] = p % S
        num_rep_E[e] += 1
    return owner_EM, num_rep_E


@DISPATCHERS.register("reduce")
class ReduceDispatcher(A2ADispatcher):
    """Local experts on every token, partial sums reduced by the caller (see the module docstring)."""

    returns_partial = True
    graph_safe = True  # no host sync, no shape that depends on the routing

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.tokens_replicated:
            raise ValueError("the reduce dispatcher needs every EP rank to hold the same tokens (tokens_replicated)")
        self.max_replicas = 1 + self.placement.num_redundant  # fixed for this dispatcher: P and E never change
        self._owner: dict = {}  # device -> (owner_EM, num_rep_E), rewritten in place by set_placement
        self._local = LocalDispatcher(self.num_local_experts)  # the sort / combine of the non-fused experts path

    def for_layer(self, layer_idx: int) -> "ReduceDispatcher":
        """As A2ADispatcher.for_layer, the copy with tables of its own (set_placement rewrites them in place)."""
        if not self.per_layer:
            return self
        twin = copy.copy(self)
        twin._owner, twin.layer_placements = {}, {}
        twin.set_placement(self.layer_placements.get(layer_idx, self.placement))
        return twin

    def set_placement(self, placement: ExpertPlacement) -> None:
        super().set_placement(placement)
        if hasattr(self, "_owner"):
            owner_EM, num_rep_E = owner_table(placement, self.rank, self.max_replicas)
            for dev_owner_EM, dev_num_rep_E in self._owner.values():  # in place: graphs read these addresses
                dev_owner_EM.copy_(owner_EM)
                dev_num_rep_E.copy_(num_rep_E)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._owner:
            owner_EM, num_rep_E = owner_table(self.placement, self.rank, self.max_replicas)
            self._owner[device] = (owner_EM.to(device), num_rep_E.to(device))
        return self._owner[device]

    def local_slots(self, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        """int32 [T, K]: the local slot that computes each routed row here, -1 where another rank does (or the
        row was dropped)."""
        owner_EM, num_rep_E = self._tables(topk_ids_TK.device)
        ids_N = topk_ids_TK.reshape(-1).long()
        e_N = ids_N.clamp_min(0)
        if self.max_replicas == 1:
            slot_N = owner_EM[e_N, 0]
        else:
            pick_N = torch.arange(ids_N.numel(), device=ids_N.device) % num_rep_E[e_N]
            slot_N = owner_EM[e_N, pick_N]
        return torch.where(ids_N >= 0, slot_N, -1).view(topk_ids_TK.shape)

    def micro_batches(self, num_tokens: int, hidden: int, itemsize: int) -> int:
        """How many token chunks the layer runs a step of T tokens as (the module docstring's Overlap):
        `overlap_micro_batches` (at most T) where overlap is on and the all-reduce payload T*D*itemsize reaches
        `overlap_min_mb`, else 1, and 1 while a CUDA graph is captured. From shapes only: every rank of the stage
        holds the same T, so every rank decides the same without a word exchanged."""
        payload_mb = num_tokens * hidden * itemsize / 1e6
        if not self.overlap or payload_mb < self.overlap_min_mb or num_tokens < 2 or _graph_capturing():
            return 1
        return min(self.overlap_micro_batches, num_tokens)

    def forward_experts(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                        experts_fn: ExpertsCall, fused_fn: Optional[FusedCall] = None) -> torch.Tensor:
        """This rank's partial out_TD: its experts' weighted outputs for the rows of every token routed to them."""
        slots_TK = self.local_slots(topk_ids_TK)
        if fused_fn is not None:
            return fused_fn(x_TD, slots_TK, topk_weights_TK)
        return self._local.forward_experts(x_TD, slots_TK, topk_weights_TK, experts_fn)
