"""The capacity all-to-all dispatcher: fixed slots, equal splits, no host sync.

Every (source rank, physical slot) pair owns C = capacity_fn(T) rows of the send buffer, so both
all-to-alls have equal, static splits and nothing waits on the host (CUDA-graph capturable). The
routing policy (drop / reroute) already limited each expert to its capacity over this rank's T
tokens, and `capacity_fn` is that same capacity, so every kept row has a slot; a row that would
not fit (only with a policy that does not enforce capacity) is dropped here and flagged in
`RoutePlan.overflow_N`. Within a slot rows keep token order (DeepSpeed's position order).

Legend: T tokens, D hidden, S local slots, P = ep*S physical slots, K top-k, N = T*K routed rows,
C capacity rows per (rank, slot), R = ep*S_m*C received rows of micro-batch m.
"""
from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch

from moe_infer.parallel.dispatcher import DISPATCHERS, A2ADispatcher, RoutePlan, weight_cols


@DISPATCHERS.register("capacity")
class CapacityDispatcher(A2ADispatcher):
    def __init__(self, *args, capacity_fn: Callable[[int], int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.capacity_fn = capacity_fn
        self._regroups: dict = {}  # (slots, C, device) -> (slot_order_R, counts_S), read-only

    def _plan(self, x_TD, ids_TK, weights_TK, ranges: Sequence[Tuple[int, int]], layer_tokens: int) -> RoutePlan:
        T, K = ids_TK.shape
        N, S, ep, D = T * K, self.num_local_experts, self.ep, x_TD.shape[1]
        P, dev = ep * S, ids_TK.device
        C = int(self.capacity_fn(layer_tokens))
        if C <= 0:
            raise ValueError(f"capacity_fn({layer_tokens}) = {C}: the capacity must be positive")
        v_N, valid_N = self._virtual_slots(ids_TK, ranges)
        key_N = torch.where(valid_N, v_N, torch.full_like(v_N, P))
        key_sorted_N, order_N = torch.sort(key_N, stable=True)
        counts_V1 = torch.zeros(P + 1, dtype=torch.int64, device=dev).scatter_add_(0, key_N, torch.ones_like(key_N))
        start_V1 = torch.cumsum(counts_V1, 0) - counts_V1
        pos_N = torch.empty_like(order_N)
        pos_N[order_N] = torch.arange(N, device=dev) - start_V1[key_sorted_N]  # rank of the row in its slot
        keep_N = valid_N & (pos_N < C)
        dest_N = torch.where(keep_N, v_N * C + pos_N, torch.full_like(v_N, P * C))
        w_NW = weight_cols(weights_TK.reshape(-1), x_TD.dtype)
        send_XD = x_TD.new_zeros(P * C + 1, D + w_NW.shape[1])  # + the trash row that dropped rows write
        send_XD[:, :D].index_copy_(0, dest_N, x_TD.unsqueeze(1).expand(T, K, D).reshape(N, D))
        send_XD[:, D:].index_copy_(0, dest_N, w_NW)
        sections = tuple(send_XD[a * ep * C:b * ep * C] for a, b in ranges)
        return RoutePlan(
            num_tokens=T, top_k=K, layer_tokens=layer_tokens, slot_ranges=tuple(ranges), send_pos_N=dest_N,
            sent_N=keep_N, overflow_N=valid_N & ~keep_N, send_rows=sections,
            send_splits=(None,) * len(ranges), recv_splits=(None,) * len(ranges), recv_counts_rS=None, capacity=C,
        )

    def _send_buffer(self, plan: RoutePlan, x_TD: torch.Tensor, m: int) -> torch.Tensor:
        return plan.send_rows[m]

    def _regroup(self, plan: RoutePlan, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = plan.slot_ranges[m]
        C, dev = plan.capacity, plan.send_pos_N.device
        key = (a, b, C, dev)
        if key not in self._regroups:  # received rows are (source, slot, c); the experts want (slot, source, c)
            if len(self._regroups) >= 16:  # a few batch sizes recur (graph buckets); bound the rest
                self._regroups.pop(next(iter(self._regroups)))
            order_R = torch.arange(self.ep * (b - a) * C, device=dev).view(self.ep, b - a, C).transpose(0, 1)
            counts_S = torch.zeros(self.num_local_experts, dtype=torch.int64, device=dev)
            counts_S[a:b] = self.ep * C
            self._regroups[key] = (order_R.reshape(-1), counts_S)
        return self._regroups[key]
