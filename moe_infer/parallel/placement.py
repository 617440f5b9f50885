"""Expert placement: which logical expert each physical expert slot of each EP rank holds.

Every rank holds `slots_per_rank` (S) physical slots; physical slot p = rank * S + s lives on rank
`p // S`. Without a placement file the layout is contiguous (logical expert e in physical slot e,
S = E / ep). A placement file adds redundant replicas of hot experts: the same logical expert in
several slots (on different ranks), and the dispatcher spreads a hot expert's rows round-robin over
its replicas. Each physical slot is loaded with its logical expert's weights.

Placement file (JSON), one list of logical experts per rank, all of the same length S:

    {"num_experts": 8, "ep": 2, "ranks": [[0, 1, 2, 3, 7], [4, 5, 6, 7, 0]]}

Optionally "layers" gives MoE layers their own placement (same S), keyed by the model's layer
index; a layer not listed uses "ranks". The lab's EPLB planner writes both
(`python -m moe_infer.launch +experiment=eplb`):

    {..., "layers": {"0": [[0, 1, 2, 5, 7], [3, 4, 5, 6, 0]], "1": [...]}}

Legend: E logical experts, P = ep * S physical slots, K top-k, T tokens, N = T*K routed rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int  # E (logical)
    ep: int  # ranks of the EP axis
    slots: tuple  # slots[rank] = tuple of the logical experts in that rank's S physical slots

    def __post_init__(self) -> None:
        if len(self.slots) != self.ep:
            raise ValueError(f"placement lists {len(self.slots)} ranks, expected ep={self.ep}")
        sizes = {len(s) for s in self.slots}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"every rank must hold the same positive number of expert slots, got {sorted(sizes)}")
        seen = set()
        for rank, rank_slots in enumerate(self.slots):
            if len(set(rank_slots)) != len(rank_slots):
                raise ValueError(f"rank {rank} holds a logical expert twice: {list(rank_slots)}")
            for e in rank_slots:
                if not 0 <= e < self.num_experts:
                    raise ValueError(f"rank {rank} names expert {e}, outside [0, {self.num_experts})")
                seen.add(e)
        missing = sorted(set(range(self.num_experts)) - seen)
        if missing:
            raise ValueError(f"experts {missing[:8]}{'...' if len(missing) > 8 else ''} have no slot on any rank")

    @property
    def slots_per_rank(self) -> int:  # S
        return len(self.slots[0])

    @property
    def num_physical(self) -> int:  # P
        return self.ep * self.slots_per_rank

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_experts

    def local_experts(self, rank: int) -> List[int]:
        """The logical expert held in each physical slot of `rank` (slot order)."""
        return list(self.slots[rank])

    def phys_to_logical(self) -> List[int]:
        return [e for rank_slots in self.slots for e in rank_slots]

    def replica_table(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """replicas_EM (int64 [E, M]: physical slots of each logical expert, padded by repeating the
        first) and num_replicas_E (int64 [E]). Replicas are listed by physical slot, so rank order."""
        phys = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(self.phys_to_logical()):
            phys[e].append(p)
        M = max(len(p) for p in phys)
        replicas_EM = torch.tensor([p + [p[0]] * (M - len(p)) for p in phys], dtype=torch.int64, device=device)
        num_replicas_E = torch.tensor([len(p) for p in phys], dtype=torch.int64, device=device)
        return replicas_EM, num_replicas_E

    def to_json(self) -> str:
        return json.dumps({"num_experts": self.num_experts, "ep": self.ep, "ranks": [list(s) for s in self.slots]})


def contiguous_placement(num_experts: int, ep: int) -> ExpertPlacement:
    """Experts [r*E/ep, (r+1)*E/ep) on rank r: the default, and what a loader reading
    `expert_start`/`num_local_experts` expects."""
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by parallel.ep={ep}; "
                         "give a placement file (parallel.placement_file) to place them unevenly")
    S = num_experts // ep
    return ExpertPlacement(num_experts, ep, tuple(tuple(range(r * S, (r + 1) * S)) for r in range(ep)))


def load_placement(path: str, num_experts: int, ep: int) -> ExpertPlacement:
    with open(path) as f:
        data = json.load(f)
    for key in ("num_experts", "ep", "ranks"):
        if key not in data:
            raise ValueError(f"placement file {path}: missing key {key!r}")
    if data["num_experts"] != num_experts or data["ep"] != ep:
        raise ValueError(f"placement file {path} is for num_experts={data['num_experts']}, ep={data['ep']}; "
                         f"the model has num_experts={num_experts} and parallel.ep={ep}")
    return ExpertPlacement(num_experts, ep, tuple(tuple(int(e) for e in r) for r in data["ranks"]))


def load_layer_placements(path: str, num_experts: int, ep: int) -> Dict[int, ExpertPlacement]:
    """The file's per-layer placements ({} without a "layers" key); each must have the shared S."""
    shared = load_placement(path, num_experts, ep)
    with open(path) as f:
        layers = json.load(f).get("layers") or {}
    if not isinstance(layers, dict):
        raise ValueError(f"placement file {path}: \"layers\" must map layer index -> ranks, got {type(layers).__name__}")
    out = {}
    for key, ranks in layers.items():
        try:
            p = ExpertPlacement(num_experts, ep, tuple(tuple(int(e) for e in r) for r in ranks))
        except (TypeError, ValueError) as err:
            raise ValueError(f"placement file {path}, layer {key}: {err}") from err
        if p.slots_per_rank != shared.slots_per_rank:
            raise ValueError(f"placement file {path}, layer {key}: {p.slots_per_rank} slots per rank, "
                             f"\"ranks\" has {shared.slots_per_rank} (every layer must hold the same number)")
        out[int(key)] = p
    return out


def replicate_hot_experts(load_E: Sequence[float], ep: int, num_redundant: int) -> ExpertPlacement:
    """A placement with `num_redundant` extra slots (a multiple of ep) given to the hottest experts.

    Contiguous base layout; each extra replica goes, hottest expert first (its load split over its
    replicas), to the rank with the least load that does not hold that expert yet.
    """
    E = len(load_E)
    if num_redundant % ep:
        raise ValueError(f"num_redundant={num_redundant} must be a multiple of ep={ep} (same slots per rank)")
    base = contiguous_placement(E, ep)
    slots = [list(s) for s in base.slots]
    replicas = [1] * E
    rank_load = [sum(load_E[e] for e in s) for s in slots]
    extra_per_rank = num_redundant // ep
    cap = base.slots_per_rank + extra_per_rank
    for _ in range(num_redundant):
        # hottest expert (per replica) that some rank with a free slot does not hold yet
        free = [r for r in range(ep) if len(slots[r]) < cap]
        candidates = [i for i in range(E) if any(i not in slots[r] for r in free)]
        e = max(candidates, key=lambda i: (load_E[i] / replicas[i], -i))
        r = min((r for r in free if e not in slots[r]), key=lambda i: (rank_load[i], i))
        share_before = load_E[e] / replicas[e]
        replicas[e] += 1
        share_after = load_E[e] / replicas[e]
        for rr in range(ep):  # the old holders each lose part of the expert's load
            if e in slots[rr]:
                rank_load[rr] -= share_before - share_after
        slots[r].append(e)
        rank_load[r] += share_after
    return ExpertPlacement(E, ep, tuple(tuple(s) for s in slots))
