"""The engine's side of speculative decoding: before each schedule, the proposals; after each step, the counts.

Which sequences propose: running ones that decode (every token but the last has its KV; not prefilling). How many
tokens (k): at most `num_speculative_tokens`, and never past what the request may still emit (max_tokens: a verify
step emits up to k + 1 tokens) or the model's length. With `adaptive` the step's k (0: a plain decode step) is the one
of the most tokens per second, from the measured acceptance rate (an exponential average over recent steps) and the
measured time of steps at each k and batch bucket (cost.py).

With async scheduling (lookahead, moe_infer/engine/async_scheduling.py) a plain step is scheduled while the step
before it runs, before its token is on the host; a proposer needs that token (the n-gram and the draft read the
sequence's tokens), and a verify step's accepted count decides the next positions. So a verify step runs
synchronously: the engine drains (collects the step in flight), proposes from every token, runs the verify step and
collects it; the next plain step resumes lookahead. Draining on every step would make the engine synchronous, so the
engine drains only where a verify step is likely to be worth it:
  - the step's k (adaptive: the cost model's choice, which weighs a verify step against the measured time of a plain
    step *with* lookahead) is above 0, and
  - some sequence's proposer may propose (`may_propose`; the n-gram: a suffix of the tokens recurs among them; the
    draft: always), read from the sequence's tokens before its last one (the ones on the host while the last is in
    flight). Only such sequences propose in the step (from all their tokens, the last included); the others run one
    token beside them. Where the sequence's last token is its first output token, or came from a verify step of its
    own, the rule reads all its tokens: a verify step is collected at once, and a step that samples a first token
    (a prompt's last chunk) is drained for it when k > 0 (one synchronous step a request), so that a copy of the
    prompt is verified from its first token on, without a step's lag.
The rule reads only the sequence's own history, never whether another sequence's verify step made this one
synchronous, so whether a sequence verifies does not depend on the batch: a seeded request with fixed k draws the
same tokens alone or in a batch. Where the n-gram's suffix stops recurring, steps go back to lookahead at once;
in a repetitive stretch verify steps follow each other (nothing is in flight between them).

Timing (adaptive k): a step's time is the host time from the previous collected step (or, where nothing was in
flight, from the start of the engine step) to its postprocessed tokens. In a stretch of lookahead steps that is the
plain step's time with its host work hidden behind the device's; a verify step's is its proposing, scheduling,
forward, sampling and postprocessing, none hidden. Steps whose sequences do not all decode are not timed, nor is the
first plain step after a synchronous one (launched into an idle pipeline), nor a drained one (its time would miss its
own launch, which fell in the time of the step before it).

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
from typing import Callable, Dict, List, Optional, Set

import numpy as np

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
                 clock: Callable[[], float] = time.perf_counter, lookahead: bool = False) -> None:
        cfg = self.cfg = engine_cfg.speculative
        self.proposer = PROPOSERS[cfg.method](cfg, engine_cfg=engine_cfg, target=runner, block_manager=block_manager)
        self.runner, self.clock = runner, clock
        self.costs = StepCosts()  # measured step seconds per (batch bucket, k): adaptive k
        self.lookahead = lookahead  # async scheduling: verify steps drain the step in flight (module docstring)
        self._mark: Optional[float] = None  # when the last collected step was postprocessed (or this step began)
        self._launched: Dict[int, tuple] = {}  # id(plan) -> (k chosen, timed) of the steps launched, not recorded
        self._k: Optional[int] = None  # this step's k, once chosen
        self._verified_last: Set[int] = set()  # sequences whose last step verified proposals of theirs
        self.num_drains = 0  # steps in flight collected early so that a verify step could be scheduled
        self.max_model_len = max_model_len
        self.acceptance = PRIOR_ACCEPTANCE
        self.num_steps = 0
        self.num_proposed = 0  # proposed tokens that a step verified
        self.num_accepted = 0  # of those, accepted
        self.num_verified = 0  # sequence-steps that verified at least one proposal
        self.last_k = 0

    # ------------------------------------------------------------------ before the schedule
    def begin_step(self, has_in_flight: bool) -> None:
        """The engine step begins; with nothing in flight its time counts from here (module docstring)."""
        if not has_in_flight:
            self._mark = self.clock()

    def must_drain(self, running: List[Sequence], in_flight_plan: SchedulerOutput) -> bool:
        """Lookahead, with a step in flight: must it be collected before this step is scheduled? When it verified (its
        accepted counts decide the next positions), or when this step is to verify (module docstring). Chooses the
        step's k (`propose` uses it)."""
        if any(item.spec_token_ids for item in in_flight_plan.seqs):
            drain = True  # k chosen after the drain
        else:
            drain = self._choose_k(running) > 0 and any(
                s.status == SequenceStatus.RUNNING and s.num_uncomputed_tokens == 1 and self._may_propose(s)
                for s in running)
        if drain:  # the drained step is not timed: its launch (host work) fell in the time of the step before it
            self.num_drains += 1
            self._launched[id(in_flight_plan)] = (0, False)
        return drain

    def _choose_k(self, running: List[Sequence]) -> int:
        decoding = sum(1 for s in running if s.status == SequenceStatus.RUNNING and s.num_uncomputed_tokens == 1)
        self.num_steps += 1
        self._k = self.last_k = self.choose_k(decoding)
        return self._k

    def _may_propose(self, seq: Sequence) -> bool:
        """Lookahead: may seq propose in this step (module docstring)? Read from all its tokens after its first token
        or a verify step of its own (the step that sampled its last token was collected at once, or is drained for
        it: its prompt's), else from its tokens before the last one (on the host or not)."""
        may = getattr(self.proposer, "may_propose", None)
        if may is None:
            return True
        if seq.num_output_tokens + seq.num_placeholders == 1 or seq.seq_id in self._verified_last:
            if seq.num_placeholders:
                return True  # its first token is in flight: drain to read it
            ids = seq.token_ids
        else:
            ids = seq.token_ids if seq.num_placeholders else seq.token_ids[:-1]
        return may(np.asarray(ids, dtype=np.int64))

    def propose(self, running: List[Sequence]) -> None:
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:  # the MTP layer reads the last step's hidden states, every step
            observe(running)
        k = self._k if self._k is not None else self._choose_k(running)
        self._k = None
        if k == 0:
            return
        seqs, ks = [], []
        for seq in running:
            if seq.status != SequenceStatus.RUNNING or seq.in_flight or seq.num_computed_tokens != len(seq) - 1:
                continue
            n = self._cap(seq, k)
            if n > 0:
                seqs.append(seq)
                ks.append(n)
        asked = [(seq, n) for seq, n in zip(seqs, ks) if not self.lookahead or self._may_propose(seq)]
        if asked:
            self.proposer.propose([seq for seq, _ in asked], [n for _, n in asked])
            self._fill(seqs, ks, k)  # the sequences not asked too: a uniform verify step

    def launched(self, plan: SchedulerOutput, behind: bool) -> None:
        """plan is launched (behind: with a step in flight before it); its time is taken when it is recorded."""
        verifies = any(item.spec_token_ids for item in plan.seqs)
        self._launched[id(plan)] = (self.last_k, verifies or behind or not self.lookahead)

    def _fill(self, seqs: List[Sequence], ks: List[int], k: int) -> None:
        """Proposals shorter than k filled up to k (module docstring), where the decode graphs replay verify steps
        of k + 1 tokens a sequence for this batch and the proposer's tokens are deterministic (no q to pad). A seeded
        sampling request is never filled: whether a sequence is depends on the batch (its size, the others'
        proposals), and the filled proposals take draws of its own generator, so its tokens would depend on the batch
        (a step with such a request and a short proposal runs without the graphs)."""
        graphs = getattr(self.runner, "graphs", None)
        if (graphs is None or getattr(graphs, "max_query_len", 1) < k + 1 or len(seqs) > graphs.max_verify_batch
                or not getattr(self.proposer, "can_fill", False) or not any(s.spec_token_ids for s in seqs)):
            return
        for seq, n in zip(seqs, ks):
            seeded = seq.params.seed is not None and not seq.params.is_greedy
            if n == k and len(seq.spec_token_ids) < k and seq.spec_probs is None and not seeded:
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
    def dropped(self, plan: SchedulerOutput) -> None:
        """A launched plan that will never be recorded (its step failed)."""
        self._launched.pop(id(plan), None)

    def record(self, plan: SchedulerOutput, tokens: list) -> None:
        """The counts of a postprocessed step (tokens: per plan entry, a list where it verified), and its time."""
        forget = getattr(self.proposer, "forget", None)
        if forget is not None and plan.finished_seq_ids:
            forget(plan.finished_seq_ids)
        proposed = accepted = 0
        verified = any(item.spec_token_ids for item in plan.seqs)
        now = self.clock()
        k, timed = self._launched.pop(id(plan), (0, False))
        if (timed and self._mark is not None and plan.seqs and all(
                item.do_sample and len(item.token_ids) == 1 + len(item.spec_token_ids or ()) for item in plan.seqs)):
            # a step of decoding sequences only (no prompt chunk beside them): its time at its k
            self.costs.add(len(plan.seqs), k if verified else 0, now - self._mark)
        self._mark = now
        for item in plan.seqs:
            (self._verified_last.add if item.spec_token_ids else self._verified_last.discard)(item.seq_id)
        self._verified_last.difference_update(plan.finished_seq_ids)
        for item, emitted in zip(plan.seqs, tokens):
            if item.spec_token_ids and isinstance(emitted, list):
                proposed += len(item.spec_token_ids)
                accepted += len(emitted) - 1
                self.num_verified += 1
        if proposed:
            self.num_proposed += proposed
            self.num_accepted += accepted
            self.acceptance = (1 - EMA) * self.acceptance + EMA * accepted / proposed
