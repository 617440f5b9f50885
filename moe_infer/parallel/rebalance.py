"""Online expert re-balancing (EPLB) under expert parallelism: re-plan from live load, move weights.

Design
------
Every `parallel.eplb_step_interval` steps, between two steps (at the start of a step, before its
tensors are built: every EP rank runs the driver's plans in the same order, so all ranks get here
together):
  1. the driver takes the rows routed to each (MoE layer, expert) since the last re-plan from the
     load statistics (the router's choice: the gate runs on every token on every rank), plans a
     placement per layer with the lab's EPLB planner (`moe_infer.lab.eplb`, imported here only
     when re-balancing is on) for the same slots per rank (the replicas' memory is fixed at
     start: `num_redundant_experts` or the placement file), aligns it to the current placement
     (`moe_infer.lab.migration`: the fewest weight copies) and keeps it only where it lowers the
     layer's most loaded rank by at least `min_gain`; it broadcasts the placements;
  2. every rank derives the same copy schedule: a slot whose expert changes copies the weights
     from the rank's own slot holding that expert if there is one, else receives them from a rank
     that holds it now (the one with the fewest sends so far); all copies of a layer go as one
     batch of point-to-point sends/receives over the EP group into new buffers, then into the slots;
  3. each layer's dispatcher routes by its new placement from the next forward on.
Outputs do not change: a placement only decides on which rank a row's expert runs, with the same
weights (greedy tokens equal the engine without re-balancing: tests/test_ep_rebalance.py). Service
does not stop: requests stay scheduled; the step after a re-plan waits for the copies
(copied slots x 3 D F x dtype bytes over the EP links) and the driver's planning.

Legend: L MoE layers, E logical experts, S slots per rank, ep ranks.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_infer.parallel.placement import ExpertPlacement

logger = logging.getLogger(__name__)
Copy = Tuple[int, int, int, int]  # (destination rank, its slot, source rank, its slot)


def copy_schedule(old: ExpertPlacement, new: ExpertPlacement) -> List[Copy]:
    """The weight copies that turn placement `old` into `new`, the same list on every rank."""
    sends = [0] * old.ep
    out = []
    for r in range(old.ep):
        for s, e in enumerate(new.slots[r]):
            if old.slots[r][s] == e:
                continue
            if e in old.slots[r]:
                out.append((r, s, r, old.slots[r].index(e)))
                continue
            holders = [(q, old.slots[q].index(e)) for q in range(old.ep) if e in old.slots[q]]
            q, qs = min(holders, key=lambda h: (sends[h[0]], h[0]))
            sends[q] += 1
            out.append((r, s, q, qs))
    return out


def move_weights(weights: Sequence[torch.Tensor], schedule: List[Copy], rank: int,
                 group: Optional[dist.ProcessGroup]) -> int:
    """Apply `schedule` to this rank's slot-major weight tensors (each [S, ...]); returns slots written."""
    ops, incoming = [], []
    for dst, ds, src, ss in schedule:
        if dst == rank:
            if src == rank:
                incoming.append((ds, [w[ss].clone() for w in weights]))
            else:
                bufs = [torch.empty_like(w[ds]) for w in weights]
                ops += [dist.P2POp(dist.irecv, b, dist.get_global_rank(group, src), group) for b in bufs]
                incoming.append((ds, bufs))
        elif src == rank:
            ops += [dist.P2POp(dist.isend, w[ss].contiguous(), dist.get_global_rank(group, dst), group)
                    for w in weights]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for ds, bufs in incoming:  # every source was read above: now overwrite
        for w, b in zip(weights, bufs):
            w[ds].copy_(b)
    return len(incoming)


class OnlineRebalancer:
    def __init__(self, ctx, moe_layers: Sequence, stats, interval: int, min_gain: float = 0.05) -> None:
        if stats is None:
            raise ValueError("parallel.enable_eplb needs the load statistics: routing.collect_stats=true")
        if any(not getattr(layer.store, "is_resident", True) for layer in moe_layers):
            raise ValueError("parallel.enable_eplb moves resident expert weights: it needs offload.store=resident")
        self.ctx, self.layers, self.stats, self.interval, self.min_gain = ctx, list(moe_layers), stats, interval, min_gain
        self.layer_ids = [layer.layer_idx for layer in self.layers]
        self.seen_LE = stats.routed_LE[self.layer_ids].clone()
        self.num_steps = self.num_rebalances = self.slots_moved = 0

    def step(self) -> None:
        """Called once per non-empty step, before it runs; re-balances every `interval` steps."""
        self.num_steps += 1
        if self.num_steps > 1 and (self.num_steps - 1) % self.interval == 0:
            self.rebalance()

    def _plan(self, load_LE) -> List[Optional[ExpertPlacement]]:
        """Driver: the new placement of each layer (None: keep the current one)."""
        import numpy as np

        from moe_infer.lab.eplb import Plan, plan_eplb
        from moe_infer.lab.migration import align

        out = []
        for layer, load_E in zip(self.layers, load_LE.double().numpy()):
            cur_p = layer.dispatcher.placement
            if load_E.sum() == 0:
                out.append(None)
                continue
            cur = Plan(np.array([cur_p.phys_to_logical()]), cur_p.num_experts, cur_p.ep)
            new = align(cur, plan_eplb(load_E[None], cur_p.ep, cur_p.num_redundant))
            gain = 1.0 - new.gpu_load(load_E[None]).max() / max(cur.gpu_load(load_E[None]).max(), 1e-30)
            if gain < self.min_gain:
                out.append(None)
                continue
            S = cur_p.slots_per_rank
            out.append(ExpertPlacement(cur_p.num_experts, cur_p.ep, tuple(
                tuple(int(e) for e in new.phy2log_LP[0, r * S:(r + 1) * S]) for r in range(cur_p.ep))))
        return out

    def rebalance(self) -> None:
        routed_LE = self.stats.routed_LE[self.layer_ids].clone()
        window_LE, self.seen_LE = (routed_LE - self.seen_LE).cpu(), routed_LE  # the one host sync
        if (window_LE < 0).any():  # the statistics were reset (LLM.reset_expert_load) since the last look
            window_LE = routed_LE.cpu()
        plans = self._plan(window_LE) if self.ctx.is_driver else None
        plans = self.ctx.broadcast_object(plans)
        moved = 0
        for layer, placement in zip(self.layers, plans):
            if placement is None:
                continue
            schedule = copy_schedule(layer.dispatcher.placement, placement)
            moved += move_weights(layer.store.weights(), schedule, self.ctx.ep_rank, self.ctx.ep_group)
            layer.dispatcher.set_placement(placement)
        self.num_rebalances += 1
        self.slots_moved += moved
        logger.info("EPLB re-plan %d after %d steps: %d layers re-placed, %d slots copied on this rank",
                    self.num_rebalances, self.num_steps - 1, sum(p is not None for p in plans), moved)
