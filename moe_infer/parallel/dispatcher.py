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
physical slots; routed rows are sorted by (micro-batch, destination rank, slot) and sent with one
`all_to_all_single`; the receiver regroups them by local slot for the experts backend (the
`DispatchMetadata` contract of `LocalDispatcher`: rows sorted by local expert, offsets_E1). Each
row carries its float32 routing weight in 4 extra bytes (1 fp32 / 2 bf16 columns) of the same
payload, so the experts backend applies it exactly as on one rank; the weighted outputs come back
and the source rank sums the K rows of each token in float32, in the single-rank order: EP output
equals the single-rank output up to the GEMMs' row blocking, for every experts backend.

Two backends (registry `DISPATCHERS`):
  exact     per-slot row counts exchanged first (a tiny all-to-all, the one host sync per layer,
            covering both micro-batches), then the payload with exact split sizes. Any T per rank.
  capacity  C = capacity(T) rows per (source rank, physical slot), one payload all-to-all each way
            with equal splits, no host sync (CUDA-graph capturable). C is the routing policy's
            per-expert capacity, so rows the policy (drop/reroute) kept always fit; T must be the
            same on every rank (true for the engine, which pads its batch). Padding rows are zeros.

Overlap. With `overlap` (and a payload of at least `overlap_min_mb`) the layer runs as two micro-batches split by expert slot (slots [0, S/2)
and [S/2, S) of every rank), not by token: each routed row belongs to exactly one micro-batch, so
the capacity buffers do not double and the K-sum stays in one place. Both dispatch all-to-alls
are issued asynchronously (they run on the process group's communication stream: NCCL's own
stream on GPU, gloo's worker thread on CPU) while the experts of micro-batch 0 run on the compute
stream; the combine of micro-batch 0 then runs under the experts of micro-batch 1.

Replicated tokens. When attention is replicated (every EP rank holds the same T tokens), a
dispatcher built with `tokens_replicated=True` lets rank r route only tokens [r*T/ep, (r+1)*T/ep)
and all-gathers the outputs, instead of sending every token ep times.

Legend: T tokens, D hidden, E logical experts, S local slots, P = ep*S physical slots, K top-k,
N = T*K routed rows, R rows received for the local slots, C capacity rows per (rank, slot).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_infer.experts.dispatcher import DispatchMetadata, LocalDispatcher
from moe_infer.parallel.placement import ExpertPlacement
from moe_infer.registry import Registry

DISPATCHERS: Registry[type] = Registry("EP dispatcher")
# torch >= 2.13 renames all_gather_into_tensor (2.11, the GPU machine, has only the old name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
ExpertsCall = Callable[[torch.Tensor, DispatchMetadata], torch.Tensor]


@dataclass(frozen=True)
class RoutePlan:
    """Source side of one layer call: where each routed row went (shared by the micro-batches)."""

    num_tokens: int  # T
    top_k: int  # K
    layer_tokens: int  # tokens of the whole MoE layer call (> T when tokens are replicated and sharded)
    slot_ranges: Tuple[Tuple[int, int], ...]  # local slots [a, b) of each micro-batch
    send_pos_N: torch.Tensor  # int64 [N]: row of the returned buffer holding routed row n (sentinel: zero row)
    sent_N: torch.Tensor  # bool [N]: rows sent to an expert (False: dropped by the policy or by capacity)
    overflow_N: torch.Tensor  # bool [N]: rows the dispatcher itself had to drop (capacity backend only)
    send_rows: Tuple[torch.Tensor, ...]  # per micro-batch: the send buffer (capacity) or its token ids (exact)
    send_splits: Tuple[Optional[List[int]], ...]  # per micro-batch rows to each rank (None: equal splits)
    recv_splits: Tuple[Optional[List[int]], ...]
    recv_counts_rS: Optional[torch.Tensor]  # int64 [ep, S]: rows from each source per local slot (exact)
    capacity: int  # C (0 for exact)


@dataclass(frozen=True)
class A2AMetadata(DispatchMetadata):
    """DispatchMetadata of one micro-batch on the receiving rank. token_idx_R holds the receive-buffer
    row of each dispatched row, inv_N the plan's send_pos_N; weights_R came with the rows; num_tokens
    is the layer's token count (what an experts backend picks its kernel config by, as on one rank)."""

    micro_batch: int
    plan: RoutePlan


def weight_columns(dtype: torch.dtype) -> int:
    """Payload columns that carry a row's float32 routing weight."""
    size = torch.empty((), dtype=dtype).element_size()
    if 4 % size:
        raise ValueError(f"cannot carry float32 weights in {dtype} columns")
    return 4 // size


def weight_cols(weights_R: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, weight_columns]: each row's float32 weight bit-cast to `dtype` columns."""
    return weights_R.float().contiguous().view(dtype).view(weights_R.shape[0], weight_columns(dtype))


def with_weights(rows_RD: torch.Tensor, weights_R: torch.Tensor) -> torch.Tensor:
    """[R, D + weight_columns]: the rows, then their float32 weights."""
    return torch.cat([rows_RD, weight_cols(weights_R, rows_RD.dtype)], dim=1)


class A2ADispatcher(LocalDispatcher):
    """Base of the all-to-all dispatchers: placement, replica choice, token sharding and the overlap
    schedule. Subclasses build the plan (`_plan`) and the receive-side regrouping (`_regroup`)."""

    def __init__(
        self,
        placement: ExpertPlacement,
        group: dist.ProcessGroup,
        rank: int,
        top_k: int,
        overlap: bool = False,
        overlap_min_mb: float = 0.0,
        tokens_replicated: bool = False,
    ) -> None:
        if dist.get_world_size(group) != placement.ep:
            raise ValueError(f"EP group has {dist.get_world_size(group)} ranks, placement expects {placement.ep}")
        super().__init__(placement.num_experts, placement.slots_per_rank, rank * placement.slots_per_rank)
        self.placement, self.group, self.rank, self.ep = placement, group, rank, placement.ep
        self.top_k, self.overlap, self.overlap_min_mb = top_k, overlap, overlap_min_mb
        self.tokens_replicated = tokens_replicated
        self.local_expert_ids = placement.local_experts(rank)
        self._tables: dict = {}

    # ---- routing to physical slots -------------------------------------------------------------
    def _slot_ranges(self, num_micro_batches: int) -> Tuple[Tuple[int, int], ...]:
        S = self.num_local_experts
        if num_micro_batches == 1 or S < 2:
            return ((0, S),)
        half = (S + 1) // 2
        return ((0, half), (half, S))

    def _virtual_slots(self, ids_TK: torch.Tensor, ranges: Sequence[Tuple[int, int]]) -> tuple:
        """v_N: each routed row's physical slot renumbered micro-batch-major ((m, rank, slot) order),
        -1 for dropped rows; valid_N; both on ids_TK's device."""
        dev = ids_TK.device
        key = (dev, tuple(ranges))
        if key not in self._tables:  # built once per device and split (host-to-device copies)
            S, ep = self.num_local_experts, self.ep
            v_P = torch.empty(ep * S, dtype=torch.int64)
            for a, b in ranges:
                for r in range(ep):
                    for s in range(a, b):
                        v_P[r * S + s] = a * ep + r * (b - a) + (s - a)
            replicas_EM, num_rep_E = self.placement.replica_table()
            v_EM = v_P[replicas_EM]  # virtual slots of each logical expert's replicas
            v_E = v_EM[:, 0].contiguous() if self.placement.num_redundant == 0 else None
            self._tables[key] = tuple(t if t is None else t.to(dev) for t in (v_E, v_EM, num_rep_E))
        v_E, v_EM, num_rep_E = self._tables[key]
        ids_N = ids_TK.reshape(-1).long()
        valid_N = ids_N >= 0
        e_N = ids_N.clamp_min(0)
        if v_E is not None:  # one slot per expert: a table lookup
            v_N = v_E[e_N]
        else:  # replicas: round-robin over them by routed row (and rank)
            pick_N = (torch.arange(ids_N.numel(), device=dev) + self.rank) % num_rep_E[e_N]
            v_N = v_EM[e_N].gather(1, pick_N[:, None]).squeeze(1)
        return torch.where(valid_N, v_N, -1), valid_N

    # ---- subclass hooks ------------------------------------------------------------------------
    def _plan(self, x_TD, ids_TK, weights_TK, ranges, layer_tokens: int) -> RoutePlan:
        raise NotImplementedError

    def _regroup(self, plan: RoutePlan, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_order_R, counts_S) of micro-batch m's received rows."""
        raise NotImplementedError

    def _send_buffer(self, plan: RoutePlan, x_TD: torch.Tensor, m: int) -> torch.Tensor:
        raise NotImplementedError

    # ---- one micro-batch: dispatch and combine, each split into start / finish -----------------
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

    def _comm_error(self, err: Exception) -> RuntimeError:
        return RuntimeError(
            f"EP all-to-all failed on EP rank {self.rank} of {self.ep}: a peer rank died, hung past the "
            f"collective timeout (parallel.timeout_s), or runs a different layer sequence ({err})"
        )

    def _start_dispatch(self, plan: RoutePlan, x_TD: torch.Tensor, m: int, async_op: bool):
        send_RD = self._send_buffer(plan, x_TD, m)
        splits = plan.recv_splits[m]
        num_recv = sum(splits) if splits is not None else send_RD.shape[0]
        recv_RD = x_TD.new_empty(num_recv, send_RD.shape[1])
        return recv_RD, self._a2a(recv_RD, send_RD, splits, plan.send_splits[m], async_op)

    def _finish_dispatch(self, plan: RoutePlan, m: int, pending) -> tuple[torch.Tensor, A2AMetadata]:
        recv_RD, work = pending
        self._wait(work)
        slot_order_R, counts_S = self._regroup(plan, m)
        offsets_S1 = torch.zeros(counts_S.numel() + 1, dtype=torch.int64, device=counts_S.device)
        torch.cumsum(counts_S, 0, out=offsets_S1[1:])
        D = recv_RD.shape[1] - weight_columns(recv_RD.dtype)
        weights_R = recv_RD[:, D:].index_select(0, slot_order_R).view(torch.float32).view(-1)
        meta = A2AMetadata(
            num_tokens=plan.layer_tokens, top_k=plan.top_k, token_idx_R=slot_order_R, weights_R=weights_R,
            counts_E=counts_S, offsets_E1=offsets_S1, inv_N=plan.send_pos_N, micro_batch=m, plan=plan,
        )
        return recv_RD[:, :D].index_select(0, slot_order_R), meta

    def _start_combine(self, y_RD: torch.Tensor, meta: A2AMetadata, async_op: bool):
        plan, m = meta.plan, meta.micro_batch
        y_recv_RD = torch.empty_like(y_RD).index_copy_(0, meta.token_idx_R, y_RD)
        splits = plan.send_splits[m]
        num_back = sum(splits) if splits is not None else y_recv_RD.shape[0]
        y_back_RD = y_RD.new_empty(num_back, y_RD.shape[1])
        return y_back_RD, self._a2a(y_back_RD, y_recv_RD, splits, plan.recv_splits[m], async_op)

    def _finish_combine(self, plan: RoutePlan, pending: Sequence) -> torch.Tensor:
        backs = []
        for y_back_RD, work in pending:
            self._wait(work)
            backs.append(y_back_RD)
        D = backs[0].shape[1]
        backs.append(backs[0].new_zeros(1, D))  # the sentinel row of dropped rows
        y_NKD = torch.cat(backs).index_select(0, plan.send_pos_N).view(plan.num_tokens, plan.top_k, D)
        return y_NKD.sum(dim=1, dtype=torch.float32).to(y_NKD.dtype)

    # ---- the LocalDispatcher interface ---------------------------------------------------------
    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK) -> tuple[torch.Tensor, A2AMetadata]:
        plan = self._plan(x_TD, topk_ids_TK, topk_weights_TK, self._slot_ranges(1), x_TD.shape[0])
        return self._finish_dispatch(plan, 0, self._start_dispatch(plan, x_TD, 0, async_op=False))

    def combine(self, y_RD: torch.Tensor, meta: A2AMetadata) -> torch.Tensor:
        if len(meta.plan.slot_ranges) != 1:
            raise ValueError("combine() takes a one-micro-batch dispatch; overlap runs through forward_experts()")
        return self._finish_combine(meta.plan, [self._start_combine(y_RD, meta, async_op=False)])

    def forward_experts(self, x_TD, topk_ids_TK, topk_weights_TK, experts_fn: ExpertsCall) -> torch.Tensor:
        """dispatch -> experts_fn(x_RD, meta) -> combine, with token sharding and overlap."""
        T = x_TD.shape[0]
        if not self.tokens_replicated:
            return self._run(x_TD, topk_ids_TK, topk_weights_TK, experts_fn, T)
        Tr = math.ceil(T / self.ep)
        pad = Tr * self.ep - T
        if pad:
            x_TD = torch.cat([x_TD, x_TD.new_zeros(pad, x_TD.shape[1])])
            topk_ids_TK = torch.cat([topk_ids_TK, topk_ids_TK.new_full((pad, topk_ids_TK.shape[1]), -1)])
            topk_weights_TK = torch.cat([topk_weights_TK, topk_weights_TK.new_zeros(pad, topk_weights_TK.shape[1])])
        mine = slice(self.rank * Tr, (self.rank + 1) * Tr)
        out_TrD = self._run(x_TD[mine], topk_ids_TK[mine], topk_weights_TK[mine], experts_fn, T)
        out_TD = out_TrD.new_empty(Tr * self.ep, out_TrD.shape[1])
        try:
            _all_gather_single(out_TD, out_TrD.contiguous(), group=self.group)
        except RuntimeError as err:
            raise self._comm_error(err) from err
        return out_TD[:T]

    def _run(self, x_TD, ids_TK, weights_TK, experts_fn: ExpertsCall, layer_tokens: int) -> torch.Tensor:
        payload_mb = layer_tokens * self.top_k * x_TD.shape[1] * x_TD.element_size() / 1e6
        use_overlap = self.overlap and payload_mb >= self.overlap_min_mb
        plan = self._plan(x_TD, ids_TK, weights_TK, self._slot_ranges(2 if use_overlap else 1), layer_tokens)
        M = len(plan.slot_ranges)
        if M == 1:
            x_RD, meta = self._finish_dispatch(plan, 0, self._start_dispatch(plan, x_TD, 0, async_op=False))
            return self._finish_combine(plan, [self._start_combine(experts_fn(x_RD, meta), meta, async_op=False)])
        dispatches = [self._start_dispatch(plan, x_TD, m, async_op=True) for m in range(M)]
        combines = []
        for m in range(M):  # experts of m overlap the dispatch of m+1 and the combine of m-1
            x_RD, meta = self._finish_dispatch(plan, m, dispatches[m])
            combines.append(self._start_combine(experts_fn(x_RD, meta), meta, async_op=True))
        return self._finish_combine(plan, combines)
