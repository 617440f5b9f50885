"""Which predicted experts to prefetch: each copy weighed against what it costs.

After layer l routes, the pre-gate (layer l+1's router on layer l's hidden state) predicts layer
l+1's experts, each with its predicted routing mass (the pre-gate's weight summed over the step's
tokens). A prefetch moves one expert over the link into one of layer l+1's few slots. When right,
layer l+1 does not miss it (a miss is a copy the layer waits for, or the expert's compute on the
CPU); right or wrong, its copy occupies the link, which on a busy link delays the copies queued
after it (by as much as the copy when the link is saturated, by nothing when it is idle); and it
takes the slot of a cached expert that may itself have been needed. Rules (registry
`PREFETCH_RULES`, config `offload.prefetch_rule`):

    all     every predicted expert, the most mass first, while slots last (`max_prefetch`); the
            cache policy picks what they evict (the rule before `saving`).
    saving  only copies whose expected saving is positive, the likeliest first, each into the slot of
            the least likely evictable resident (a free slot first):
                p_c * miss_s - busy * copy_s - p_v * miss_s > 0   and   p_c >= prefetch_min_prob
            p_c: the probability that candidate c is needed; p_v: that the expert it evicts (the
            victim; 0 for a free slot) is needed; miss_s: what a miss costs (the cost model's copy
            or CPU time for one row, per the miss policy); copy_s: one expert's copy; busy: the
            link's recent busy share (`Copier.busy_share`). With miss_s = copy_s it reads
            p_c - p_v > busy: on a saturated link only sure prefetches into the slots of unlikely
            experts; on an idle link any candidate likelier than its victim and than the floor
            `prefetch_min_prob` (no churn on coin flips).

Probabilities are calibrated online (`Calibration`), manager-wide: a pre-gate weight is not a
probability (top-k weights are renormalized; a replayed trace has ranks only). When a layer runs,
each expert its pre-gate predicted is counted under (its mass bin, whether the layer needed it in
its previous step) as needed or not, and each cached expert the pre-gate did not pick under
(whether the layer needed it in its previous step). An estimate is the decayed needed share of its
bin, starting from a prior at the bin's weight.
"""
from __future__ import annotations

from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from moe_infer.registry import Registry

Key = Tuple[str, int, bool]  # ("pred", mass bin, needed last step) | ("cached", 0, needed last step)
Choice = Tuple[int, Optional[int]]  # (expert to copy, expert whose slot it takes; None: free slot or the policy's pick)
MASS_UNIT = 65536.0  # the store's predicted mass is an integer in units of 2^-16
_PRIORS = [(b + 0.5) / 10 for b in range(10)] + [0.9, 0.95, 0.97]  # mass bins: tenths below 1, then [1,2) [2,4) 4+
_CACHED_PRIOR = {True: 0.2, False: 0.05}


def mass_bin(mass: float) -> int:
    if mass < 1.0:
        return min(int(mass * 10), 9)
    return 10 if mass < 2.0 else 11 if mass < 4.0 else 12


class Calibration:
    """P(needed) per key from decayed (needed, seen) counts and a prior worth `prior_weight` observations."""

    def __init__(self, decay: float = 0.998, prior_weight: float = 2.0) -> None:
        self.decay, self.prior_weight = decay, prior_weight
        self.counts: Dict[Key, List[float]] = {}

    @staticmethod
    def prior(key: Key) -> float:
        kind, b, recent = key
        return _PRIORS[b] if kind == "pred" else _CACHED_PRIOR[recent]

    def p(self, key: Key) -> float:
        needed, seen = self.counts.get(key, (0.0, 0.0))
        return (needed + self.prior_weight * self.prior(key)) / (seen + self.prior_weight)

    def observe(self, key: Key, needed: bool) -> None:
        c = self.counts.setdefault(key, [0.0, 0.0])
        c[0] = c[0] * self.decay + float(needed)
        c[1] = c[1] * self.decay + 1.0

    def describe(self) -> Dict[str, float]:
        return {f"{k[0]}{k[1] if k[0] == 'pred' else ''}{'_recent' if k[2] else ''}": round(self.p(k), 3)
                for k in sorted(self.counts)}


RuleFn = Callable[..., List[Choice]]
PREFETCH_RULES: Registry[RuleFn] = Registry("offload prefetch rule")


@PREFETCH_RULES.register("all")
def prefetch_all(candidates: Sequence[Tuple[int, float]], residents: Sequence[Tuple[int, float]], free: int,
                 limit: int, miss_s: float, link_s: float, min_prob: float) -> List[Choice]:
    """Every candidate (in the given order: the most predicted mass first) up to `limit`."""
    return [(e, None) for e, _ in candidates[:limit]]


@PREFETCH_RULES.register("saving")
def prefetch_saving(candidates: Sequence[Tuple[int, float]], residents: Sequence[Tuple[int, float]], free: int,
                    limit: int, miss_s: float, link_s: float, min_prob: float) -> List[Choice]:
    """candidates: (expert, p needed) not cached; residents: (expert, p needed) evictable, coldest first by
    the cache policy; free: free slots. Pairs the likeliest candidate with the least likely slot while
    the expected saving is positive (both sorted, so the first pair that loses ends the search)."""
    by_p = sorted(candidates, key=lambda c: -c[1])  # stable: equal p keep the mass order
    slots: List[Tuple[Optional[int], float]] = [(None, 0.0)] * free + sorted(residents, key=lambda r: r[1])
    out: List[Choice] = []
    for (e, p_c), (victim, p_v) in zip(by_p, slots):
        if len(out) >= limit or p_c < min_prob or p_c * miss_s - link_s - p_v * miss_s <= 0.0:
            break
        out.append((e, victim))
    return out


class Prefetcher:
    """The manager's prefetch decision: the rule, the calibration, the costs it weighs."""

    def __init__(self, cfg, manager) -> None:
        self.rule = PREFETCH_RULES.get(cfg.prefetch_rule)
        self.min_prob = cfg.prefetch_min_prob
        self.manager = manager
        self.calibration = Calibration()

    def costs(self) -> Tuple[float, float]:
        """(miss_s, busy * copy_s) for one expert: see the module docstring (1, 1 before the cost model exists)."""
        m = self.manager
        if m.cost is None:
            return 1.0, 1.0
        copy_s = m.cost.copy_seconds(m.shape.nbytes)
        cpu_s = m.cost.cpu_seconds(1)
        miss_s = {"wait": copy_s, "cpu": cpu_s}.get(m.cfg.miss_policy, min(copy_s, cpu_s))
        return miss_s, copy_s * m.copier.busy_share()

    def decide(self, want: List[int], scores: List[int], cached: Dict[Hashable, int], evictable: List[int],
               free: int, recent: set, limit: int) -> Tuple[List[Choice], List[Tuple[int, Key]]]:
        """want: predicted experts, the most mass first; scores: mass per expert (MASS_UNIT); cached: the
        table's expert -> slot; evictable: cached and unpinned, coldest first; recent: needed in the layer's
        previous step. Returns the copies and the (expert, key) pairs to observe when the layer runs."""
        cal, wanted = self.calibration, set(want)
        keys: Dict[int, Key] = {e: ("pred", mass_bin(scores[e] / MASS_UNIT), e in recent) for e in want}
        keys.update({e: ("cached", 0, e in recent) for e in cached if e not in wanted})
        candidates = [(e, cal.p(keys[e])) for e in want if e not in cached]
        residents = [(e, cal.p(keys[e])) for e in evictable]
        miss_s, link_s = self.costs()
        choices = self.rule(candidates, residents, free, limit, miss_s, link_s, self.min_prob)
        return choices, list(keys.items())

    def observe(self, pending: List[Tuple[int, Key]], needed) -> None:
        for e, key in pending:
            self.calibration.observe(key, e in needed)
