"""Adaptive k from measured step times: which k (0: a plain decode step) gives the most tokens per second.

The engine times every step whose sequences all decode (host time from the proposals to the postprocessed tokens:
proposing, scheduling, the forward and the sampling, with the host syncs the step really has), and files it under
the step's batch bucket (a power of two) and its k. Per (bucket, k) it keeps an exponential average of the seconds;
the first step of each pair is left out (it may have captured a CUDA graph or compiled a kernel), and so is a step
over OUTLIER times its pair's average (a graph captured for a new context bucket) unless MAX_OUTLIERS come in a row.

With a the measured per-token acceptance rate, a step at k emits E(k) = 1 + a + ... + a^k tokens a sequence
(E(0) = 1), and k is chosen to maximise E(k) / t(bucket, k). A pair not measured yet is estimated from the pair of
its bucket measured most, scaled by the prior cost model (a verify step's tokens cost little while decoding is bound
by reading the weights, more as the batch grows; a proposal costs `proposal_cost` of a step):

    prior(k) = 1 + k * B / saturation + k * c

so an unmeasured k is tried when the prior says it pays, and dropped once its measured time says it does not. Every
PROBE_EVERY-th step (8; every PROBE_SETTLED-th once each k of the bucket has MIN_SAMPLES samples) measures the k of the
bucket with the fewest samples instead, so that the acceptance rate and the costs stay current (a plain step where
speculation pays, a verify step where it does not: at 128 steps apart, a probe twice as slow as the step it
replaces costs under 1%).

Pure Python, no engine import: the policy is tested with injected times (tests/test_spec_cost.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

EMA = 0.2  # the weight of a new step time in its pair's average
PROBE_EVERY = 8  # steps: measure the least-measured k of the bucket this often while one has < MIN_SAMPLES
PROBE_SETTLED = 128  # steps: the same once every k of the bucket has them (a probe is a slower step)
MIN_SAMPLES = 3
SKIP_FIRST = 1  # samples of a pair left out (graph capture, kernel compiles)
OUTLIER = 3.0  # a sample this many times its pair's average is left out (a graph captured for a new context
MAX_OUTLIERS = 3  # bucket), unless this many come in a row (the step really got slower)


def batch_bucket(batch: int) -> int:
    return 1 << max(batch - 1, 0).bit_length()


class StepCosts:
    """Measured step seconds per (batch bucket, k)."""

    def __init__(self) -> None:
        self.seconds: Dict[Tuple[int, int], float] = {}
        self.counts: Dict[Tuple[int, int], int] = {}
        self._outliers: Dict[Tuple[int, int], int] = {}  # outliers in a row, per pair

    def add(self, batch: int, k: int, seconds: float) -> None:
        key = (batch_bucket(batch), k)
        n = self.counts[key] = self.counts.get(key, 0) + 1
        if n <= SKIP_FIRST:
            return
        old = self.seconds.get(key)
        if old is not None and seconds > OUTLIER * old:
            n_out = self._outliers[key] = self._outliers.get(key, 0) + 1
            if n_out < MAX_OUTLIERS:
                return
            old = None  # a new level: start over from it
        self._outliers[key] = 0
        self.seconds[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def count(self, batch: int, k: int) -> int:
        return self.counts.get((batch_bucket(batch), k), 0)

    def estimate(self, batch: int, k: int, prior: List[float]) -> float:
        """Seconds of a step at k (prior[k]: the relative prior cost of each k, used for unmeasured pairs)."""
        bucket = batch_bucket(batch)
        got = self.seconds.get((bucket, k))
        if got is not None:
            return got
        measured = [(self.counts[(bucket, j)], j) for j in range(len(prior)) if (bucket, j) in self.seconds]
        if not measured:
            return prior[k]  # nothing measured in the bucket: the prior's units throughout
        _, j = max(measured)
        return self.seconds[(bucket, j)] * prior[k] / prior[j]


def choose_k(costs: StepCosts, batch: int, max_k: int, acceptance: float, saturation: float,
             proposal_cost: float, step_index: int) -> int:
    """The k in 0..max_k of the most expected tokens per second at this batch (module docstring)."""
    a = min(max(acceptance, 0.0), 0.999)
    prior = [1 + k * batch / saturation + k * proposal_cost for k in range(max_k + 1)]
    best_k, best = 0, None
    for k in range(max_k + 1):
        rate = (1 - a ** (k + 1)) / (1 - a) / costs.estimate(batch, k, prior)
        if best is None or rate > best * 1.0001:
            best_k, best = k, rate
    settled = all(costs.count(batch, k) >= MIN_SAMPLES for k in range(max_k + 1))
    if step_index > 0 and step_index % (PROBE_SETTLED if settled else PROBE_EVERY) == 0:
        least: Optional[int] = None
        for k in range(max_k + 1):
            if k != best_k and (least is None or costs.count(batch, k) < costs.count(batch, least)):
                least = k
        if least is not None:
            return least
    return best_k
