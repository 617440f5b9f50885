"""The engine's side of speculative decoding: before each schedule, the proposals; after each step, the counts.

Which sequences propose: running ones that decode (every token but the last has its KV; not prefilling). How many
tokens (k): at most `num_speculative_tokens`, and never past what the request may still emit (max_tokens: a verify
step emits up to k + 1 tokens) or the model's length. With `adaptive` the step's k (0: a plain decode step) is the one
of the most tokens per second, from the measured acceptance rate (an exponential average over recent steps) and the
measured time of steps at each k and batch bucket (cost.py). Every step whose sequences all decode is timed here:
from `propose` to `record` (proposing, scheduling, the forward, sampling, postprocessing).

Uniform verify steps: where the decode graphs take verify steps (speculative/graphs.py), a step in which some
sequences' proposals are shorter than k (the n-gram found a shorter match, or none) is filled up to k tokens each
(the last proposal, or the last token, repeated), so that every sequence runs k + 1 tokens and the step replays a
graph; a filled-in token is verified like any proposal (the output is still the model's). A step where no sequence
found a proposal stays a plain decode step.

Metrics (`LLMEngine.get_stats`, the server's /metrics): proposed and accepted tokens, verified sequence-steps; the
acceptance rate is accepted / proposed, the mean accepted length (tokens a sequence-step emits) 1 + accepted /
verified.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional

from moe_infer.config import EngineConfig
from moe_infer.engine.sequence import SchedulerOutput, Sequence, SequenceStatus
from moe_infer.engine.speculative.cost import StepCosts, choose_k

logger = logging.getLogger(__name__)

EMA = 0.2  # the weight of a step's acceptance rate in the running average
PRIOR_ACCEPTANCE = 0.6  # the running average before the first measurement


def _ngram(cfg, **kw):
    from moe_infer.engine.speculative.ngram import NgramProposer

    return NgramProposer(cfg, **kw)


def _draft(cfg, **kw):
    from moe_infer.engine.speculative.draft import DraftProposer

    return DraftProposer(cfg, **kw)


def _mtp(cfg, **kw):
    from moe_infer.engine.speculative.mtp import MTPProposer

    return MTPProposer(cfg, **kw)


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
    def __init__(self, engine_cfg: EngineConfig, runner, block_manager, max_model_len: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        cfg = self.cfg = engine_cfg.speculative
        self.proposer = PROPOSERS[cfg.method](cfg, engine_cfg=engine_cfg, target=runner, block_manager=block_manager)
        self.runner, self.clock = runner, clock
        self.costs = StepCosts()  # measured step seconds per (batch bucket, k): adaptive k
        self._timing: Optional[tuple] = None  # (start, batch, k) of the step being timed
        self.max_model_len = max_model_len
        self.acceptance = PRIOR_ACCEPTANCE
        self.num_steps = 0
        self.num_proposed = 0  # proposed tokens that a step verified
        self.num_accepted = 0  # of those, accepted
        self.num_verified = 0  # sequence-steps that verified at least one proposal
        self.last_k = 0

    # ------------------------------------------------------------------ before the schedule
    def propose(self, running: List[Sequence]) -> None:
        start = self.clock()
        decoding = [s for s in running if s.status == SequenceStatus.RUNNING and not s.in_flight
                    and s.num_computed_tokens == len(s) - 1]
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:  # the MTP layer reads the last step's hidden states, every step
            observe(running)
        self.num_steps += 1
        k = self.last_k = self.choose_k(len(decoding))
        # timed only where every running sequence decodes (a prompt chunk in the step would cost more)
        self._timing = (start, len(decoding), k) if decoding and len(decoding) == len(running) else None
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
            self._fill(seqs, ks, k)

    def _fill(self, seqs: List[Sequence], ks: List[int], k: int) -> None:
        """Proposals shorter than k filled up to k (module docstring), where the decode graphs replay verify steps
        of k + 1 tokens a sequence for this batch and the proposer's tokens are deterministic (no q to pad)."""
        graphs = getattr(self.runner, "graphs", None)
        if (graphs is None or getattr(graphs, "max_query_len", 1) < k + 1 or len(seqs) > graphs.max_verify_batch
                or not getattr(self.proposer, "can_fill", False) or not any(s.spec_token_ids for s in seqs)):
            return
        for seq, n in zip(seqs, ks):
            if n == k and len(seq.spec_token_ids) < k and seq.spec_probs is None:
                last = seq.spec_token_ids[-1] if seq.spec_token_ids else seq.token_ids[-1]
                seq.spec_token_ids = list(seq.spec_token_ids) + [last] * (k - len(seq.spec_token_ids))

    def choose_k(self, batch: int) -> int:
        cfg = self.cfg
        K, limit = cfg.num_speculative_tokens, cfg.disable_by_batch_size
        if batch == 0 or (limit is not None and batch >= limit):
            return 0
        if not cfg.adaptive:
            return K
        return choose_k(self.costs, batch, K, self.acceptance, float(limit if limit is not None else 64),
                        getattr(self.proposer, "proposal_cost", 0.0), self.num_steps)

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
        verified = any(item.spec_token_ids for item in plan.seqs)
        if self._timing is not None and len(plan.seqs) == self._timing[1] and all(
                len(item.token_ids) == 1 + len(item.spec_token_ids or ()) for item in plan.seqs):
            # a step of decoding sequences only (no prompt scheduled beside them): its time at its k
            start, batch, k = self._timing
            self.costs.add(batch, k if verified else 0, self.clock() - start)
        self._timing = None
        for item, emitted in zip(plan.seqs, tokens):
            if item.spec_token_ids and isinstance(emitted, list):
                proposed += len(item.spec_token_ids)
                accepted += len(emitted) - 1
                self.num_verified += 1
        if proposed:
            self.num_proposed += proposed
            self.num_accepted += accepted
            self.acceptance = (1 - EMA) * self.acceptance + EMA * accepted / proposed
