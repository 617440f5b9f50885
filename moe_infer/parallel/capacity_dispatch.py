"""The capacity all-to-all dispatcher: fixed slots, equal splits, no host sync.

Every (source rank, physical slot) pair owns C = capacity_fn(T) rows of the send buffer, so both
all-to-alls have equal, static splits and nothing waits on the host (CUDA-graph capturable). The
routing policy (drop / reroute) already limited each expert to its capacity over this rank's T
tokens, and `capacity_fn` is that same capacity, so every kept row has a slot; a row that would
not fit (only with a policy that does not enforce capacity) is dropped here and flagged in
`RoutePlan.overflow_N`. Within a slot rows keep token order (DeepSpeed's position order).

Dispatch, per layer call, up to SLOT_PACK_MAX_ROWS routed rows: one launch per micro-batch
(`slot_pack`: one program per virtual slot picks its rows, replicas included, ranks them in row
order, writes their send rows and packs the slot's C rows, padding zeroed). Above that, the steps run
apart: the rank of each routed row within its slot (`expert_ranks`, the routing package's kernel: 3
launches on CUDA), its send row and the inverse map (`slot_rows`, 1 launch + a fill), then per
micro-batch its section of the send buffer (`pack_rows`, 1 launch). Either way a micro-batch is
packed right before its all-to-all (`_send_buffer`), so with overlap the pack of micro-batch m+1 runs
while micro-batch m is on the wire; `RoutePlan.send_pos_N` is complete once every micro-batch is
packed. Received rows need no regroup on the fused path (their slot is a function of the row:
`SlotTables.capacity_layout`).

Legend: T tokens, D hidden, S local slots, P = ep*S physical slots, K top-k, N = T*K routed rows,
C capacity rows per (rank, slot), X = P*C send rows, R = ep*S_m*C received rows of micro-batch m.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from moe_infer.kernels.ep_row_ops import SLOT_PACK_MAX_ROWS, row_ops
from moe_infer.kernels.ep_ops_torch import weight_columns
from moe_infer.parallel.all_to_all import DISPATCHERS, A2ADispatcher, RoutePlan
from moe_infer.parallel.slots import sections
from moe_infer.routing.capacity_ops import expert_ranks_torch


def expert_ranks(keys_TK: torch.Tensor, num_keys: int) -> torch.Tensor:
    """rank_N: position of each routed row among the rows of its key, in row order (-1 for key < 0)."""
    if keys_TK.is_cuda:
        from moe_infer.routing.triton_permute import expert_ranks_triton

        return expert_ranks_triton(keys_TK, num_keys)[0]
    return expert_ranks_torch(keys_TK, num_keys)[0]


@dataclass(frozen=True)
class CapacityPack:
    """What `_send_buffer` packs micro-batch m from, right before its all-to-all."""

    out_XC: torch.Tensor  # the micro-batch's section of the send buffer
    v_start: int  # its first virtual slot
    w_N: torch.Tensor  # float32 routing weights
    ids_N: Optional[torch.Tensor] = None  # slot_pack: the routed logical ids (-1 dropped)
    slots_V3: Optional[torch.Tensor] = None  # slot_pack: the virtual slot table
    src_X: Optional[torch.Tensor] = None  # separate steps: the source row of each row of the section


@DISPATCHERS.register("capacity")
class CapacityDispatcher(A2ADispatcher):
    slot_pack_max_rows = SLOT_PACK_MAX_ROWS  # routed rows up to which dispatch is the one `slot_pack` launch

    def __init__(self, *args, capacity_fn: Callable[[int], int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.capacity_fn = capacity_fn

    def _plan(self, x_TD, ids_TK, weights_TK, ranges: Sequence[Tuple[int, int]], layer_tokens: int) -> RoutePlan:
        T, K = ids_TK.shape
        ep, D, dev = self.ep, x_TD.shape[1], ids_TK.device
        C = int(self.capacity_fn(layer_tokens))
        if C <= 0:
            raise ValueError(f"capacity_fn({layer_tokens}) = {C}: the capacity must be positive")
        if x_TD.shape[0] != T or weights_TK.shape != ids_TK.shape:
            raise ValueError(f"x_TD {tuple(x_TD.shape)}, ids {tuple(ids_TK.shape)} and weights "
                             f"{tuple(weights_TK.shape)} disagree")
        X = ep * self.num_local_experts * C
        send_XC = x_TD.new_empty(X, D + weight_columns(x_TD.dtype))
        w_N = weights_TK.reshape(-1).float().contiguous()
        secs = sections(ranges, C, ep)
        if T * K <= self.slot_pack_max_rows:  # one launch per micro-batch, in _send_buffer
            keys_N = ids_TK.reshape(-1).contiguous()
            dest_N = torch.empty(T * K, dtype=torch.int64, device=dev)
            table_V3 = self.slots.slot_table(dev, tuple(ranges))
            packs = tuple(CapacityPack(send_XC[lo:hi], a * ep, w_N, ids_N=keys_N, slots_V3=table_V3)
                          for (a, _), (lo, hi) in zip(ranges, secs))
        else:
            keys_N, table_V, num_keys = self.slots.slot_keys(ids_TK, tuple(ranges))
            rank_N = expert_ranks(keys_N.view(T, K), num_keys)
            dest_N, src_X = row_ops(dev).slot_rows(keys_N, rank_N, table_V, C, X)
            packs = tuple(CapacityPack(send_XC[lo:hi], a * ep, w_N, src_X=src_X[lo:hi])
                          for (a, _), (lo, hi) in zip(ranges, secs))
        M = len(ranges)
        return RoutePlan(
            num_tokens=T, top_k=K, layer_tokens=layer_tokens, slot_ranges=tuple(ranges), ids_N=keys_N,
            send_pos_N=dest_N, num_send_rows=X, send_sections=secs, send_rows=packs,
            send_splits=(None,) * M, recv_splits=(None,) * M, recv_counts_rS=None, capacity=C,
        )

    def _send_buffer(self, plan: RoutePlan, x_TD: torch.Tensor, m: int) -> torch.Tensor:
        pack: CapacityPack = plan.send_rows[m]
        ops = row_ops(x_TD.device)
        if pack.src_X is None:
            ops.slot_pack(x_TD, pack.ids_N, pack.w_N, pack.slots_V3, self.rank, plan.capacity, plan.top_k, pack.out_XC,
                          plan.send_pos_N, pack.v_start)
        else:
            ops.pack_rows(x_TD, pack.w_N, pack.src_X, plan.top_k, pack.out_XC)
        return pack.out_XC

    def _recv_slots(self, plan: RoutePlan, m: int) -> torch.Tensor:
        a, b = plan.slot_ranges[m]
        return self.slots.capacity_layout(a, b, plan.capacity, plan.send_pos_N.device)[0]

    def _regroup(self, plan: RoutePlan, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = plan.slot_ranges[m]
        return self.slots.capacity_layout(a, b, plan.capacity, plan.send_pos_N.device)[1:]
