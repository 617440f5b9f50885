"""All-to-all token dispatchers for expert parallelism (EP > 1).

Design
------
Which experts live where. The EP axis of the mesh has `ep` ranks; each holds S physical expert
slots (`ExpertPlacement`): by default the contiguous block [r*E/ep, (r+1)*E/ep), which is what a
checkpoint loader reading `expert_start`/`num_local_experts` expects, and which keeps each rank's
weights one contiguous slice of the checkpoint. A placement file can give hot experts redundant
replicas on other ranks: a routed row of a replicated expert goes to replica (n + rank) mod
#replicas, so a hot expert's rows spread evenly and no rank is the straggler of every layer.
Weights are never moved at run time: tokens move to the experts (an expert's weights, 3*D*F
values, outweigh the few rows routed to it at inference batch sizes).

What moves. The router's choice (logical ids, -1 = dropped by the capacity policy) is mapped to
physical slots; routed rows are laid out by (micro-batch, destination rank, slot) in one send
buffer by one kernel (`moe_infer.kernels.ep_ops.pack_rows`) and sent with one `all_to_all_single`.
Each row carries its float32 routing weight in 4 extra bytes (1 fp32 / 2 bf16 columns) of the same
payload. The receiver runs the experts on the received buffer as it lies, (source rank, slot, row):
  fused     an experts backend that declares `fused_experts` (the layer hands it over as
            `fused_fn`) takes the buffer as "tokens" with top-k 1 and id = local slot (-1 for empty
            capacity rows, found from their zero weight): no regroup copy, and its output is already
            in the order of the return all-to-all;
  regroup   any other backend gets the rows sorted by local slot (the `DispatchMetadata` contract
            of `LocalDispatcher`: offsets_E1) and its output is put back in receive order.
The weighted outputs come back with one all-to-all into one buffer and one kernel sums the K rows
of each token in float32 (`combine_rows`): EP output equals the single-rank output up to the
GEMMs' row blocking, for every experts backend. On CPU the same steps run the ops' PyTorch
references (`EP_ROW_OPS["torch"]`).

Two backends (registry `DISPATCHERS`):
  exact     per-slot row counts exchanged first (a tiny all-to-all, the one host sync per layer,
            covering both micro-batches), then the payload with exact split sizes. Any T per rank.
  capacity  C = capacity(T) rows per (source rank, physical slot), one payload all-to-all each way
            with equal splits, no host sync (CUDA-graph capturable). C is the routing policy's
            per-expert capacity, so rows the policy (drop/reroute) kept always fit; T must be the
            same on every rank (true for the engine, which pads its batch). Padding rows are zeros.

Overlap. With `overlap` (and a payload of at least `overlap_min_mb`) the layer runs as M =
`overlap_micro_batches` (default 2) micro-batches split by expert slot (M contiguous groups of
every rank's slots, e.g. [0, S/2) and [S/2, S)), not by token:
each routed row belongs to exactly one micro-batch, so the capacity buffers do not double and the
K-sum stays in one place. All dispatch all-to-alls are issued asynchronously (they run on the
process group's communication stream: NCCL's own stream on GPU, gloo's worker thread on CPU)
while the experts of micro-batch 0 run on the compute stream; the combine of micro-batch m then
runs under the experts of micro-batch m+1.

Replicated tokens. When attention is replicated (every EP rank holds the same T tokens), a
dispatcher built with `tokens_replicated=True` lets rank r route only tokens [r*T/ep, (r+1)*T/ep)
and all-gathers the outputs, instead of sending every token ep times.

Legend: T tokens, D hidden, E logical experts, S local slots, P = ep*S physical slots, K top-k,
N = T*K routed rows, R rows received for the local slots, C capacity rows per (rank, slot),
X rows of the send buffer (all micro-batches).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_infer.experts.local_dispatch import DispatchMetadata, LocalDispatcher
from moe_infer.kernels.ep_row_ops import row_ops
from moe_infer.kernels.ep_ops_torch import weight_columns
from moe_infer.parallel.placement import ExpertPlacement
from moe_infer.parallel.slots import SlotTables
from moe_infer.registry import Registry

__all__ = ["A2ADispatcher", "A2AMetadata", "DISPATCHERS", "ExpertsCall", "FusedCall", "RoutePlan", "weight_columns"]

DISPATCHERS: Registry[type] = Registry("EP dispatcher")
# torch >= 2.13 renames all_gather_into_tensor (2.11, the GPU machine, has only the old name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
ExpertsCall = Callable[[torch.Tensor, DispatchMetadata], torch.Tensor]
# (x_RD, ids_R1 local slot or -1, weights_R1 float32) -> weighted y_RD, rows in any order
FusedCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RoutePlan:
    """Source side of one layer call: where each routed row went (shared by the micro-batches)."""

    num_tokens: int  # T
    top_k: int  # K
    layer_tokens: int  # tokens of the whole MoE layer call (> T when tokens are replicated and sharded)
    slot_ranges: Tuple[Tuple[int, int], ...]  # local slots [a, b) of each micro-batch
    ids_N: torch.Tensor  # the ids routed (-1: dropped by the policy)
    send_pos_N: torch.Tensor  # int64 [N]: send-buffer row of routed row n; >= num_send_rows: not sent
    # (capacity: an entry is written when its micro-batch is packed, `_send_buffer`)
    num_send_rows: int  # X, over all micro-batches; the returned rows land in the same rows
    send_sections: Tuple[Tuple[int, int], ...]  # rows [a, b) of the send buffer of each micro-batch
    send_rows: Tuple[object, ...]  # per micro-batch: what `_send_buffer` packs it from
    send_splits: Tuple[Optional[List[int]], ...]  # per micro-batch rows to each rank (None: equal splits)
    recv_splits: Tuple[Optional[List[int]], ...]
    recv_counts_rS: Optional[torch.Tensor]  # int64 [ep, S]: rows from each source per local slot (exact)
    capacity: int  # C (0 for exact)

    @property
    def sent_N(self) -> torch.Tensor:
        """bool [N]: rows sent to an expert (False: dropped by the policy or by capacity)."""
        return self.send_pos_N < self.num_send_rows

    @property
    def overflow_N(self) -> torch.Tensor:
        """bool [N]: rows the dispatcher itself had to drop (capacity backend only)."""
        return (self.ids_N.reshape(-1) >= 0) & ~self.sent_N


@dataclass(frozen=True)
class A2AMetadata(DispatchMetadata):
    """DispatchMetadata of one micro-batch on the receiving rank (regroup path). token_idx_R holds
    the receive-buffer row of each dispatched row, inv_N the plan's send_pos_N; weights_R came with
    the rows; num_tokens is the layer's token count (what an experts backend picks its kernel
    config by, as on one rank)."""

    micro_batch: int
    plan: RoutePlan


class A2ADispatcher(LocalDispatcher):
    """Base of the all-to-all dispatchers: placement, replica choice, token sharding, the experts call
    on the received buffer and the overlap schedule. Subclasses build the plan (`_plan`), the send
    buffer of a micro-batch (`_send_buffer`) and say which local slot each received row is for."""

    def __init__(
        self,
        placement: ExpertPlacement,
        group: dist.ProcessGroup,
        rank: int,
        top_k: int,
        overlap: bool = False,
        overlap_min_mb: float = 0.0,
        tokens_replicated: bool = False,
        overlap_micro_batches: int = 2,
        on_error: Optional[Callable[[str, BaseException], BaseException]] = None,
    ) -> None:
        if dist.get_world_size(group) != placement.ep:
            raise ValueError(f"EP group has {dist.get_world_size(group)} ranks, placement expects {placement.ep}")
        super().__init__(placement.num_experts, placement.slots_per_rank, rank * placement.slots_per_rank)
        self.placement, self.group, self.rank, self.ep = placement, group, rank, placement.ep
        self.top_k, self.overlap, self.overlap_min_mb = top_k, overlap, overlap_min_mb
        self.tokens_replicated, self.overlap_micro_batches = tokens_replicated, overlap_micro_batches
        self.local_expert_ids = placement.local_experts(rank)
        self.slots = SlotTables(placement, rank)
        self.on_error = on_error  # the mesh's: names the rank that did not come (ParallelContext.failure)
        self.layer_placements: Dict[int, ExpertPlacement] = {}  # per-layer placements (placement file "layers")
        self.per_layer = False  # True: every MoE layer gets its own copy (per-layer files, online re-balancing)

    def for_layer(self, layer_idx: int) -> "A2ADispatcher":
        """This dispatcher for one MoE layer: with `per_layer`, a copy with its own placement (the
        layer's entry of `layer_placements`, else the shared one) that online re-balancing may change
        alone; otherwise this one, shared by every layer."""
        if not self.per_layer:
            return self
        twin = copy.copy(self)
        twin.layer_placements = {}
        twin.set_placement(self.layer_placements.get(layer_idx, self.placement))
        return twin

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by `placement` from the next call on (between steps: the caller moves the weights)."""
        if (placement.ep, placement.slots_per_rank, placement.num_experts) != (
                self.ep, self.num_local_experts, self.num_experts):
            raise ValueError(f"placement with ep={placement.ep}, S={placement.slots_per_rank}, E={placement.num_experts} "
                             f"does not fit this dispatcher (ep={self.ep}, S={self.num_local_experts}, E={self.num_experts})")
        self.placement = placement
        self.local_expert_ids = placement.local_experts(self.rank)
        self.slots = SlotTables(placement, self.rank)

    def _slot_ranges(self, num_micro_batches: int) -> Tuple[Tuple[int, int], ...]:
        """min(M, S) contiguous groups of local slots, near-equal, the larger first."""
        S = self.num_local_experts
        M = max(1, min(num_micro_batches, S))
        size, extra = divmod(S, M)
        starts = [m * size + min(m, extra) for m in range(M + 1)]
        return tuple((starts[m], starts[m + 1]) for m in range(M))

    # ---- subclass hooks ------------------------------------------------------------------------
    def _plan(self, x_TD, ids_TK, weights_TK, ranges, layer_tokens: int) -> RoutePlan:
        raise NotImplementedError

    def _send_buffer(self, plan: RoutePlan, x_TD: torch.Tensor, m: int) -> torch.Tensor:
        raise NotImplementedError

    def _recv_slots(self, plan: RoutePlan, m: int) -> torch.Tensor:
        """int [R]: the local slot of each row micro-batch m receives."""
        raise NotImplementedError

    def _regroup(self, plan: RoutePlan, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_order_R, counts_S) of micro-batch m's received rows (regroup path)."""
        raise NotImplementedError

    # ---- communication -------------------------------------------------------------------------
    def _a2a(self, out, inp, out_splits, in_splits, async_op: bool):
        try:
            return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=async_op)
        except RuntimeError as err:
            raise self._comm_error(err) from err

    def _wait(self, work) -> None:
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as err:
            raise self._comm_error(err) from err

    def _comm_error(self, err: Exception) -> BaseException:
        if self.on_error is not None:
            return self.on_error("EP all-to-all", err)
        return RuntimeError(
            f"EP all-to-all failed on EP rank {self.rank} of {self.ep}: a peer rank died, hung past the "
            f"collective timeout (parallel.timeout_s), or runs a different layer sequence ({err})"
        )

    # ---- one micro-batch: dispatch, experts, combine -------------------------------------------
    def _start_dispatch(self, plan: RoutePlan, x_TD: torch.Tensor, m: int, async_op: bool):
        send_XC = self._send_buffer(plan, x_TD, m)
        splits = plan.recv_splits[m]
        num_recv = sum(splits) if splits is not None else send_XC.shape[0]
        recv_XC = x_TD.new_empty(num_recv, send_XC.shape[1])
        return recv_XC, self._a2a(recv_XC, send_XC, splits, plan.send_splits[m], async_op)

    def _received(self, pending) -> torch.Tensor:
        recv_XC, work = pending
        self._wait(work)
        return recv_XC

    def _regrouped(self, plan: RoutePlan, m: int, recv_XC: torch.Tensor) -> tuple[torch.Tensor, A2AMetadata]:
        slot_order_R, counts_S = self._regroup(plan, m)
        offsets_S1 = torch.zeros(counts_S.numel() + 1, dtype=torch.int64, device=counts_S.device)
        torch.cumsum(counts_S, 0, out=offsets_S1[1:])
        D = recv_XC.shape[1] - weight_columns(recv_XC.dtype)
        weights_R = recv_XC[:, D:].index_select(0, slot_order_R).contiguous().view(torch.float32).view(-1)
        meta = A2AMetadata(
            num_tokens=plan.layer_tokens, top_k=plan.top_k, token_idx_R=slot_order_R, weights_R=weights_R,
            counts_E=counts_S, offsets_E1=offsets_S1, inv_N=plan.send_pos_N, micro_batch=m, plan=plan,
        )
        return recv_XC[:, :D].index_select(0, slot_order_R), meta

    def _experts(self, plan: RoutePlan, m: int, pending, experts_fn: ExpertsCall,
                 fused_fn: Optional[FusedCall]) -> torch.Tensor:
        """Weighted expert outputs of micro-batch m's received rows, in receive order."""
        recv_XC = self._received(pending)
        D = recv_XC.shape[1] - weight_columns(recv_XC.dtype)
        if fused_fn is not None:  # no regroup: the buffer as it lies, empty rows skipped by id -1
            ids_X, w_X = row_ops(recv_XC.device).recv_rows(recv_XC, self._recv_slots(plan, m), D)
            return fused_fn(recv_XC[:, :D], ids_X[:, None], w_X[:, None])
        x_RD, meta = self._regrouped(plan, m, recv_XC)
        return self._to_receive_order(experts_fn(x_RD, meta), meta)

    @staticmethod
    def _to_receive_order(y_RD: torch.Tensor, meta: A2AMetadata) -> torch.Tensor:
        return torch.empty_like(y_RD).index_copy_(0, meta.token_idx_R, y_RD)

    def _start_combine(self, plan: RoutePlan, m: int, y_XD: torch.Tensor, y_back_XD: torch.Tensor, async_op: bool):
        a, b = plan.send_sections[m]
        return self._a2a(y_back_XD[a:b], y_XD, plan.send_splits[m], plan.recv_splits[m], async_op)

    def _finish_combine(self, plan: RoutePlan, works: Sequence, y_back_XD: torch.Tensor) -> torch.Tensor:
        for work in works:
            self._wait(work)
        return row_ops(y_back_XD.device).combine_rows(y_back_XD, plan.send_pos_N, plan.num_tokens, plan.top_k)

    # ---- the LocalDispatcher interface ---------------------------------------------------------
    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK) -> tuple[torch.Tensor, A2AMetadata]:
        plan = self._plan(x_TD, topk_ids_TK, topk_weights_TK, self._slot_ranges(1), x_TD.shape[0])
        return self._regrouped(plan, 0, self._received(self._start_dispatch(plan, x_TD, 0, async_op=False)))

    def combine(self, y_RD: torch.Tensor, meta: A2AMetadata) -> torch.Tensor:
        plan = meta.plan
        if len(plan.slot_ranges) != 1:
            raise ValueError("combine() takes a one-micro-batch dispatch; overlap runs through forward_experts()")
        y_back_XD = y_RD.new_empty(plan.num_send_rows, y_RD.shape[1])
        work = self._start_combine(plan, 0, self._to_receive_order(y_RD, meta), y_back_XD, async_op=False)
        return self._finish_combine(plan, [work], y_back_XD)

    def forward_experts(self, x_TD, topk_ids_TK, topk_weights_TK, experts_fn: ExpertsCall,
                        fused_fn: Optional[FusedCall] = None) -> torch.Tensor:
        """dispatch -> experts -> combine, with token sharding and overlap. fused_fn (optional): the
        experts over rows in any order, ids = local slot; used instead of experts_fn (no regroup)."""
        T = x_TD.shape[0]
        if not self.tokens_replicated:
            return self._run(x_TD, topk_ids_TK, topk_weights_TK, experts_fn, fused_fn, T)
        Tr = math.ceil(T / self.ep)
        pad = Tr * self.ep - T
        if pad:
            x_TD = torch.cat([x_TD, x_TD.new_zeros(pad, x_TD.shape[1])])
            topk_ids_TK = torch.cat([topk_ids_TK, topk_ids_TK.new_full((pad, topk_ids_TK.shape[1]), -1)])
            topk_weights_TK = torch.cat([topk_weights_TK, topk_weights_TK.new_zeros(pad, topk_weights_TK.shape[1])])
        mine = slice(self.rank * Tr, (self.rank + 1) * Tr)
        out_TrD = self._run(x_TD[mine], topk_ids_TK[mine], topk_weights_TK[mine], experts_fn, fused_fn, T)
        out_TD = out_TrD.new_empty(Tr * self.ep, out_TrD.shape[1])
        try:
            _all_gather_single(out_TD, out_TrD.contiguous(), group=self.group)
        except RuntimeError as err:
            raise self._comm_error(err) from err
        return out_TD[:T]

    def _run(self, x_TD, ids_TK, weights_TK, experts_fn, fused_fn, layer_tokens: int) -> torch.Tensor:
        payload_mb = layer_tokens * self.top_k * x_TD.shape[1] * x_TD.element_size() / 1e6
        use_overlap = self.overlap and payload_mb >= self.overlap_min_mb
        num_micro_batches = self.overlap_micro_batches if use_overlap else 1
        plan = self._plan(x_TD, ids_TK, weights_TK, self._slot_ranges(num_micro_batches), layer_tokens)
        y_back_XD = x_TD.new_empty(plan.num_send_rows, x_TD.shape[1])
        if len(plan.slot_ranges) == 1:
            y_XD = self._experts(plan, 0, self._start_dispatch(plan, x_TD, 0, async_op=False), experts_fn, fused_fn)
            return self._finish_combine(plan, [self._start_combine(plan, 0, y_XD, y_back_XD, False)], y_back_XD)
        dispatches = [self._start_dispatch(plan, x_TD, m, async_op=True) for m in range(len(plan.slot_ranges))]
        works = []
        for m, pending in enumerate(dispatches):  # experts of m overlap the dispatch of m+1 and the combine of m-1
            y_XD = self._experts(plan, m, pending, experts_fn, fused_fn)
            works.append(self._start_combine(plan, m, y_XD, y_back_XD, async_op=True))
        return self._finish_combine(plan, works, y_back_XD)
