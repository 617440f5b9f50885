"""Device tables of the all-to-all dispatchers: logical expert -> virtual slot, replica choice, and the
layout of the capacity buffers. Built once per (device, micro-batch split, capacity) and cached, so
a layer call only launches kernels (no host-to-device copies, no host sync after the first call).

Virtual slots number the physical slots micro-batch-major: slot s of rank r in the micro-batch of
local slots [a, b) is v = a*ep + r*(b - a) + (s - a). Sorting routed rows by v lays them out as
(micro-batch, destination rank, slot), the order of the send buffers.

Legend: E logical experts, M replicas per expert (padded), S local slots, P = ep*S physical slots,
K top-k, N = T*K routed rows, C capacity rows per (rank, slot), R received rows of a micro-batch.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from moe_infer.parallel.placement import ExpertPlacement

Ranges = Tuple[Tuple[int, int], ...]
_MAX_CACHED = 16  # a few batch sizes recur (CUDA-graph buckets); bound the rest


class SlotTables:
    def __init__(self, placement: ExpertPlacement, rank: int) -> None:
        self.placement, self.rank, self.ep = placement, rank, placement.ep
        self.num_local_slots = placement.slots_per_rank
        self.has_replicas = placement.num_redundant > 0
        self._virtual: Dict[tuple, tuple] = {}
        self._capacity: Dict[tuple, tuple] = {}
        self._slot_table: Dict[tuple, torch.Tensor] = {}

    def _virtual_of_physical(self, ranges: Ranges) -> torch.Tensor:
        """v_P (int64, CPU): the virtual slot of each physical slot p = r * S + s."""
        S, ep = self.num_local_slots, self.ep
        v_P = torch.empty(ep * S, dtype=torch.int64)
        for a, b in ranges:
            for r in range(ep):
                for s in range(a, b):
                    v_P[r * S + s] = a * ep + r * (b - a) + (s - a)
        return v_P

    def _tables(self, device: torch.device, ranges: Ranges) -> tuple:
        """(v_E or None, v_EM, num_rep_E, identity_P) on `device`."""
        key = (device, tuple(ranges))
        if key not in self._virtual:
            S, ep = self.num_local_slots, self.ep
            v_P = self._virtual_of_physical(ranges)
            replicas_EM, num_rep_E = self.placement.replica_table()
            v_EM = v_P[replicas_EM]  # virtual slots of each logical expert's replicas
            v_E = None if self.has_replicas else v_EM[:, 0].contiguous()
            tables = (v_E, v_EM, num_rep_E, torch.arange(ep * S, dtype=torch.int64))
            self._virtual[key] = tuple(t if t is None else t.to(device) for t in tables)
        return self._virtual[key]

    def slot_table(self, device: torch.device, ranges: Ranges) -> torch.Tensor:
        """slots_V3 (int32 [P, 3]) for `slot_pack`: per virtual slot its logical expert, its replica index
        (replicas in physical-slot order, as `virtual_slots` picks them) and the expert's replica count."""
        key = (device, tuple(ranges))
        if key not in self._slot_table:
            v_P = self._virtual_of_physical(ranges)
            logical_P = self.placement.phys_to_logical()
            replicas = {}
            table_V3 = torch.empty(v_P.numel(), 3, dtype=torch.int32)
            for p, e in enumerate(logical_P):
                table_V3[v_P[p], 0] = e
                table_V3[v_P[p], 1] = replicas.setdefault(e, 0)
                replicas[e] += 1
            table_V3[:, 2] = torch.tensor([replicas[int(e)] for e in table_V3[:, 0]], dtype=torch.int32)
            self._slot_table[key] = table_V3.to(device)
        return self._slot_table[key]

    def slot_keys(self, ids_TK: torch.Tensor, ranges: Ranges) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """(keys_N, table_V, V): rows with equal key go to the same virtual slot table_V[key]; -1 = dropped.
        Without replicas the keys are the logical ids themselves (no launch)."""
        v_E, v_EM, num_rep_E, ident_P = self._tables(ids_TK.device, ranges)
        if v_E is not None:
            return ids_TK.reshape(-1), v_E, v_E.numel()
        v_N, _ = self.virtual_slots(ids_TK, ranges)
        return v_N, ident_P, ident_P.numel()

    def virtual_slots(self, ids_TK: torch.Tensor, ranges: Ranges) -> Tuple[torch.Tensor, torch.Tensor]:
        """(v_N int64, -1 for dropped rows; valid_N). A replicated expert's rows go round-robin over its
        replicas by routed row (and rank), so its load spreads evenly."""
        v_E, v_EM, num_rep_E, _ = self._tables(ids_TK.device, ranges)
        ids_N = ids_TK.reshape(-1).long()
        valid_N = ids_N >= 0
        e_N = ids_N.clamp_min(0)
        if v_E is not None:
            v_N = v_E[e_N]
        else:
            pick_N = (torch.arange(ids_N.numel(), device=ids_N.device) + self.rank) % num_rep_E[e_N]
            v_N = v_EM[e_N].gather(1, pick_N[:, None]).squeeze(1)
        return torch.where(valid_N, v_N, -1), valid_N

    def capacity_layout(self, a: int, b: int, capacity: int, device: torch.device) -> tuple:
        """(slot_X, slot_order_R, counts_S) of a capacity micro-batch of local slots [a, b): the received
        buffer is (source rank, slot, row); slot_X is each row's local slot, slot_order_R the rows
        sorted by slot (regroup path), counts_S rows per local slot."""
        key = (a, b, capacity, device)
        if key not in self._capacity:
            if len(self._capacity) >= _MAX_CACHED:
                self._capacity.pop(next(iter(self._capacity)))
            ep, C, S = self.ep, capacity, self.num_local_slots
            x_R = torch.arange(ep * (b - a) * C, device=device)
            slot_X = a + (x_R // C) % (b - a)
            order_R = x_R.view(ep, b - a, C).transpose(0, 1).reshape(-1)
            counts_S = torch.zeros(S, dtype=torch.int64, device=device)
            counts_S[a:b] = ep * C
            self._capacity[key] = (slot_X, order_R, counts_S)
        return self._capacity[key]


def sections(ranges: Sequence[Tuple[int, int]], rows_per_slot: int, ep: int) -> Tuple[Tuple[int, int], ...]:
    """Rows [a*ep*C, b*ep*C) of the capacity send buffer for each micro-batch of local slots [a, b)."""
    return tuple((a * ep * rows_per_slot, b * ep * rows_per_slot) for a, b in ranges)
