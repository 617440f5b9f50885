"""Synthetic routing traces in the engine's trace format (`moe_infer.routing.trace`).

Each step draws, per MoE layer, an expert popularity p_E from the chosen pattern; every token of
the step picks K distinct experts with probability proportional to p (Gumbel top-k: the top K of
log p_E + Gumbel noise are a draw without replacement), and its router weights are the softmax of
those K perturbed scores. The perturbed scores are the trace's router logits (`with_logits`), so
policies that need logits (reroute, drop by score) replay on synthetic traces too. Each layer gets
its own random ranking of the experts, so hot experts differ between layers as in real models.

Patterns (registry `PATTERNS`):
  uniform   p_E = 1/E
  zipf      p of the expert ranked r is proportional to 1 / r^zipf_s
  bursty    uniform, plus bursts: a burst starts at a step with probability burst_prob, lasts
            burst_steps steps and multiplies the popularity of hot_experts random experts by hot_boost
  drifting  a hot set of hot_experts consecutive experts (in the layer's ranking), hot_boost times
            as popular as the others, that moves one expert every drift_steps steps

Legend: L layers, E experts, K top-k, T tokens of a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from moe_infer.registry import Registry

if TYPE_CHECKING:  # imported where a trace is built: the launcher composes SyntheticSpec before torch loads
    from moe_infer.routing.trace import RoutingTrace

# (spec, rng, step, rank_LE, state dict) -> p_LE for that step
PatternFn = Callable[["SyntheticSpec", np.random.Generator, int, np.ndarray, dict], np.ndarray]
PATTERNS: Registry[PatternFn] = Registry("synthetic routing pattern")


@dataclass
class SyntheticSpec:
    pattern: str = "zipf"
    num_experts: int = 64
    top_k: int = 8
    num_layers: int = 4
    num_steps: int = 64
    tokens_per_step: int = 256
    zipf_s: float = 1.0
    hot_experts: int = 8
    hot_boost: float = 8.0
    burst_prob: float = 0.1
    burst_steps: int = 4
    drift_steps: int = 4
    seed: int = 0
    with_logits: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "num_layers", "num_steps", "tokens_per_step", "hot_experts",
                     "burst_steps", "drift_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"synthetic.{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"synthetic.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.hot_experts > self.num_experts:
            raise ValueError(f"synthetic.hot_experts={self.hot_experts} exceeds num_experts={self.num_experts}")
        if self.zipf_s < 0 or self.hot_boost <= 0 or not 0 <= self.burst_prob <= 1:
            raise ValueError("synthetic.zipf_s must be >= 0, hot_boost > 0 and burst_prob in [0, 1]")
        if self.pattern not in PATTERNS:
            raise ValueError(f"synthetic.pattern={self.pattern!r} is not one of {PATTERNS.names()}")


@PATTERNS.register("uniform")
def _uniform(spec, rng, step, rank_LE, state) -> np.ndarray:
    return np.full(rank_LE.shape, 1.0 / spec.num_experts)


@PATTERNS.register("zipf")
def _zipf(spec, rng, step, rank_LE, state) -> np.ndarray:
    return 1.0 / (rank_LE + 1.0) ** spec.zipf_s


@PATTERNS.register("bursty")
def _bursty(spec, rng, step, rank_LE, state) -> np.ndarray:
    L, E = rank_LE.shape
    left = state.setdefault("left_L", np.zeros(L, dtype=np.int64))
    hot = state.setdefault("hot_LE", np.zeros((L, E), dtype=bool))
    start_L = (left == 0) & (rng.random(L) < spec.burst_prob)
    for layer in np.flatnonzero(start_L):
        hot[layer] = False
        hot[layer, rng.choice(E, spec.hot_experts, replace=False)] = True
        left[layer] = spec.burst_steps
    hot[left == 0] = False
    p_LE = np.where(hot, spec.hot_boost, 1.0)
    left[:] = np.maximum(left - 1, 0)
    return p_LE


@PATTERNS.register("drifting")
def _drifting(spec, rng, step, rank_LE, state) -> np.ndarray:
    E = spec.num_experts
    start = step // spec.drift_steps
    in_hot_LE = (rank_LE - start) % E < spec.hot_experts
    return np.where(in_hot_LE, spec.hot_boost, 1.0)


def generate(spec: SyntheticSpec) -> RoutingTrace:
    """A trace of spec.num_steps steps of spec.tokens_per_step tokens (reproducible from spec.seed)."""
    from moe_infer.routing.trace import RoutingTrace

    rng = np.random.default_rng(spec.seed)
    L, E, K, T = spec.num_layers, spec.num_experts, spec.top_k, spec.tokens_per_step
    rank_LE = np.argsort(rng.random((L, E)), axis=1).argsort(axis=1)  # each layer's random expert ranking
    pattern, state = PATTERNS.get(spec.pattern), {}
    ids, weights, logits = [], [], []
    for step in range(spec.num_steps):
        p_LE = pattern(spec, rng, step, rank_LE, state)
        score_LTE = np.log(p_LE / p_LE.sum(1, keepdims=True))[:, None, :] + rng.gumbel(size=(L, T, E))
        top_LTK = np.argpartition(-score_LTE, K - 1, axis=2)[:, :, :K]
        top_score_LTK = np.take_along_axis(score_LTE, top_LTK, axis=2)
        order = np.argsort(-top_score_LTK, axis=2)  # the router's order: best first
        top_LTK = np.take_along_axis(top_LTK, order, axis=2)
        top_score_LTK = np.take_along_axis(top_score_LTK, order, axis=2)
        w_LTK = np.exp(top_score_LTK - top_score_LTK[:, :, :1])
        ids.append(top_LTK)
        weights.append(w_LTK / w_LTK.sum(2, keepdims=True))
        if spec.with_logits:
            logits.append(score_LTE.astype(np.float32))
    info = {"source": "moe_infer.lab.synthetic", "synthetic": vars(spec).copy(), "model": f"synthetic-{spec.pattern}"}
    return RoutingTrace(np.concatenate(ids, 1), np.concatenate(weights, 1),
                        np.repeat(np.arange(spec.num_steps, dtype=np.int32), T), E, list(range(L)),
                        router_logits_LTE=np.concatenate(logits, 1) if spec.with_logits else None, info=info)
