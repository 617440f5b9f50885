"""The engine's side of speculative decoding: before each schedule, the proposals; after each step, the counts.

Which sequences propose: running ones that decode (every token but the last has its KV; not prefilling). How many
tokens (k): at most `num_speculative_tokens`, and never past what the request may still emit (max_tokens: a verify
step emits up to k + 1 tokens) or the model's length. With `adaptive` the step's k is chosen from the measured
acceptance rate a (an exponential average over recent steps) and the batch size B:

    expected tokens a sequence emits per step   E(k) = 1 + a + ... + a^k
    cost of the step relative to a plain decode C(k) = 1 + k * B / disable_by_batch_size + k * c

k maximises E(k) / C(k) over 1..num_speculative_tokens; when even the best is not above 1, the step does not
speculate, except every PROBE_EVERY-th step (k = 1), so that the rate keeps being measured. The cost model says that
a step's tokens cost little while the batch is small (decoding is memory-bound) and as much as a decode step each
once B reaches `disable_by_batch_size`, where speculation is off (vLLM's name for the threshold); c is the cost
of proposing one token relative to a target step (the proposer's `proposal_cost`: 0 for n-gram, a draft model's
weight bytes over the target's, at least 0.1, for a draft).

Metrics (`LLMEngine.get_stats`, the server's /metrics): proposed and accepted tokens, verified sequence-steps; the
acceptance rate is accepted / proposed, the mean accepted length (tokens a sequence-step emits) 1 + accepted /
verified.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List

from moe_infer.config import EngineConfig
from moe_infer.engine.sequence import SchedulerOutput, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

PROBE_EVERY = 16  # steps: adaptive k probes with k = 1 this often when it chose 0
EMA = 0.2  # the weight of a step's acceptance rate in the running average
PRIOR_ACCEPTANCE = 0.6  # the running average before the first measurement


def _ngram(cfg, **kw):
    from moe_infer.engine.speculative.ngram import NgramProposer

    return NgramProposer(cfg, **kw)


def _draft(cfg, **kw):
    from moe_infer.engine.speculative.draft import DraftProposer

    return DraftProposer(cfg, **kw)


def _mtp(cfg, **kw):
    raise ValueError("speculative.method=mtp: DeepSeek-V3's multi-token-prediction layers are recognised but not "
                     "loaded yet (moe_infer/models/loader.py); use method=ngram or method=draft")


PROPOSERS: Dict[str, Callable] = {"ngram": _ngram, "draft": _draft, "mtp": _mtp}


def speculation_blocker(cfg: EngineConfig) -> None:
    """Refuse the configurations speculative decoding does not support, naming them (ValueError)."""
    if not cfg.speculative.enabled:
        return
    p = cfg.parallel
    if p.force_mesh or p.tp > 1 or p.pp > 1 or p.ep > 1:
        mesh = f"parallel.tp={p.tp}, pp={p.pp}, ep={p.ep}{', force_mesh' if p.force_mesh else ''}"
        raise ValueError(f"speculative.method={cfg.speculative.method} under a mesh ({mesh}) is not supported yet: "
                         f"speculative decoding runs on one rank")


class Speculator:
    def __init__(self, engine_cfg: EngineConfig, runner, block_manager, max_model_len: int) -> None:
        cfg = self.cfg = engine_cfg.speculative
        self.proposer = PROPOSERS[cfg.method](cfg, engine_cfg=engine_cfg, target=runner, block_manager=block_manager)
        self.max_model_len = max_model_len
        self.acceptance = PRIOR_ACCEPTANCE
        self.num_steps = 0
        self.num_proposed = 0  # proposed tokens that a step verified
        self.num_accepted = 0  # of those, accepted
        self.num_verified = 0  # sequence-steps that verified at least one proposal
        self.last_k = 0

    # ------------------------------------------------------------------ before the schedule
    def propose(self, running: List[Sequence]) -> None:
        decoding = [s for s in running if s.status == SequenceStatus.RUNNING and not s.in_flight
                    and s.num_computed_tokens == len(s) - 1]
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
        self.num_steps += 1
        k = self.last_k = self.choose_k(len(decoding))
        if k == 0:
            return
        seqs, ks = [], []
        for seq in decoding:
            n = self._cap(seq, k)
            if n > 0:
                seqs.append(seq)
                ks.append(n)
        if seqs:
            self.proposer.propose(seqs, ks)

    def choose_k(self, batch: int) -> int:
        cfg = self.cfg
        K, limit = cfg.num_speculative_tokens, cfg.disable_by_batch_size
        if batch == 0 or (limit is not None and batch >= limit):
            return 0
        if not cfg.adaptive:
            return K
        a, sat = min(self.acceptance, 0.999), float(limit if limit is not None else 64)
        c = getattr(self.proposer, "proposal_cost", 0.0)
        best_k, best = 0, 1.0
        for k in range(1, K + 1):
            ratio = (1 - a ** (k + 1)) / (1 - a) / (1 + k * batch / sat + k * c)
            if ratio > best * 1.0001:
                best_k, best = k, ratio
        if best_k == 0 and self.num_steps % PROBE_EVERY == 0:
            return 1
        return best_k

    def _cap(self, seq: Sequence, k: int) -> int:
        p = seq.params
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)  # the step emits up to k + 1 tokens
        k = min(k, self.max_model_len - len(seq))  # positions up to len + k - 1
        cap = self.proposer.max_tokens(seq)
        return k if cap is None else min(k, cap)

    # ------------------------------------------------------------------ after a step
    def record(self, plan: SchedulerOutput, tokens: list) -> None:
        """The counts of a postprocessed step (tokens: per plan entry, a list where it verified)."""
        forget = getattr(self.proposer, "forget", None)
        if forget is not None and plan.finished_seq_ids:
            forget(plan.finished_seq_ids)
        proposed = accepted = 0
        for item, emitted in zip(plan.seqs, tokens):
            if item.spec_token_ids and isinstance(emitted, list):
                proposed += len(item.spec_token_ids)
                accepted += len(emitted) - 1
                self.num_verified += 1
        if proposed:
            self.num_proposed += proposed
            self.num_accepted += accepted
            self.acceptance = (1 - EMA) * self.acceptance + EMA * accepted / proposed
