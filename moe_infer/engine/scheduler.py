"""Continuous batching: which sequences run this step, with how many tokens each. No tensors here.

One token budget per step (`max_num_batched_tokens`) is shared by everything: running sequences go
first, oldest first (a decode takes 1 token, an unfinished prefill its next chunk), then waiting
requests are admitted in arrival order while `max_num_seqs` and the budget allow, a long prompt
taking only the chunk that fits (chunked prefill). When a running sequence needs a block and none
is free, the newest running sequence is preempted: its blocks are freed and it goes back to the
front of the waiting queue to be recomputed (its finished blocks usually come back from the prefix
cache). No new request is admitted in a step that preempted.

A request that can never run (prompt longer than max_model_len, or than the whole KV cache) is
finished at once with finish_reason "error" and the reason in `seq.error`; the others go on.

The samples of an n > 1 request after the first (`seq.leader` set) are passed over at admission
until the leader's prompt is computed, so that they find its blocks in the prefix cache instead of
computing the prompt again (with prefix caching off they are admitted like any request).

Pipeline stages (num_batches = pp > 1): a step's batch is postprocessed pp steps later, so a
sequence whose batch is still in flight is skipped (it needs that batch's token) and never preempted
(its blocks are being written); each batch takes at most 1/pp of the unfinished sequences, so the pp
batches in flight share them.

Async scheduling (lookahead=True, moe_infer/engine/async_scheduling.py): step n+1 is scheduled while
step n runs, before its tokens are known. A sequence in step n goes on: its next chunk if it is
prefilling, else one token, the placeholder for the token step n samples (the runner takes it from
step n's sampled ids on the device). A sequence that step n finishes by length for sure (max_tokens,
max_model_len) is not scheduled again, and its seat under `max_num_seqs` goes to a waiting request
(new ones take free blocks only); one that stops on a token or a stop string is, and that extra
token is discarded: a sequence finished while a batch in flight holds it keeps its blocks until
that batch is postprocessed (the GPU may still write them). The step waits for step n instead
(an empty plan: the executor then returns step n, and the next step is scheduled as without
lookahead) when the KV cache cannot hold every running sequence's next chunk (preemption must see
step n's tokens and frees); a sequence sampling with penalties gets its history without step n's
token, which the sampler counts from the step's input ids on the device. Without pipeline stages or
lookahead nothing is ever in flight at schedule time.

Speculative decoding (moe_infer/engine/speculative/): a decoding sequence with proposed tokens (`spec_token_ids`, set
before the schedule) runs its last token and the proposals, k + 1 tokens of the budget (the proposals cut to fit it),
every one sampled; postprocess takes the list of tokens the verification kept, appends them up to the first that stops
the sequence, and gives back the blocks past its computed tokens (rejected proposals). With lookahead the engine
schedules a verify step only with nothing in flight, and collects it before the next schedule.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Deque, Dict, List, Optional

from moe_infer.engine.block_manager import BlockManager
from moe_infer.engine.prompt_limits import PromptLimits
from moe_infer.engine.sequence import PLACEHOLDER_TOKEN, ScheduledSeq, SchedulerOutput, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 eos_token_ids: Optional[List[int]] = None, num_batches: int = 1, lookahead: bool = False) -> None:
        if lookahead and num_batches > 1:
            raise ValueError("async scheduling (lookahead) and pipeline stages (num_batches > 1) do not mix")
        self.block_manager = block_manager
        self.num_batches = num_batches  # batches in flight at once (pipeline stages)
        self.lookahead = lookahead  # async scheduling: schedule on top of the batch in flight
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.limits = PromptLimits(max_model_len, block_manager.num_blocks, block_manager.block_size,
                                   None if enable_chunked_prefill else max_num_batched_tokens)
        self.eos_token_ids = set(eos_token_ids or [])
        self.waiting: Deque[Sequence] = deque()
        self.running: List[Sequence] = []
        self._finished_ids: List[int] = []
        self._held: Dict[int, Sequence] = {}  # finished while in flight: blocks freed when their batch is done
        self.num_preemptions = 0  # total, for tests and metrics
        self.num_chunked_prefills = 0  # prompt chunks that did not reach the prompt's end

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        """Queue seq, or finish it with an error when it can never run."""
        error = self.admission_error(len(seq))
        if error is not None:
            seq.finish("error", error=error)
            return
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str, stop_reason: object = None, error: Optional[str] = None) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if self.lookahead and seq.in_flight:  # a batch in flight writes its KV: free when it is postprocessed
            self._held[seq.seq_id] = seq
        else:
            self.block_manager.free(seq)
        seq.finish(reason, stop_reason, error)
        self._finished_ids.append(seq.seq_id)

    def has_unfinished(self) -> bool:
        """Sequences to run, or finished ones whose batch in flight must still be postprocessed."""
        return bool(self.waiting or self.running or self._held)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput()
        if self.lookahead and self._must_wait():  # an empty plan: the batch in flight comes back first
            out.finished_seq_ids, self._finished_ids = self._finished_ids, []
            return out
        preempted = blocked = False
        max_seqs = math.ceil((len(self.running) + len(self.waiting)) / self.num_batches)  # this batch's share
        can_wait = any(seq.in_flight for seq in self.running)  # a batch in flight will bring blocks back
        seated = self._num_seated() if self.waiting else 0  # before this plan schedules the running ones again
        i = 0
        while i < len(self.running) and budget > 0 and len(out.seqs) < max_seqs:
            seq = self.running[i]
            if seq.in_flight and not (self.lookahead and self._goes_on(seq)):
                i += 1
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            spec = seq.spec_token_ids[:budget - 1] if seq.spec_token_ids and seq.num_uncomputed_tokens == 1 else ()
            num_new += len(spec)  # speculative decoding: the proposed tokens are verified in this step
            while not self.block_manager.can_append(seq, seq.num_scheduled_tokens + num_new):
                victim = self._victim(seq, can_wait)
                if victim is None:  # wait for the batches in flight rather than preempt
                    blocked = True
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if blocked or seq.status != SequenceStatus.RUNNING:  # seq preempted itself
                break
            self.block_manager.append(seq, seq.num_scheduled_tokens + num_new)
            out.seqs.append(self._plan_verify(seq, spec) if spec else self._plan(seq, num_new))
            budget -= num_new
            i += 1
        for seq in list(self.waiting) if not (preempted or blocked) else []:  # arrival order
            if budget <= 0 or seated >= self.max_num_seqs or len(out.seqs) >= max_seqs:
                break
            if self._waits_for_leader(seq):
                continue
            cached_ids = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached_ids) * self.block_manager.block_size
            num_new = min(len(seq) - num_cached, budget)
            if num_new < len(seq) - num_cached and not self.enable_chunked_prefill:
                break
            if not self.block_manager.can_allocate(num_cached + num_new, cached_ids):
                if not self.running:  # nothing will ever free a block: the cache is too small for it
                    self.finish(seq, "error", error=self.limits.kv_overflow(len(seq)))
                    continue
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, num_cached + num_new, cached_ids)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seated += 1
            out.seqs.append(self._plan(seq, num_new))
            budget -= num_new
        out.finished_seq_ids, self._finished_ids = self._finished_ids, []
        return out

    def postprocess(self, plan: SchedulerOutput, sampled: List[Optional[int]]) -> List[Sequence]:
        """Advance the computed counts, append sampled tokens; finish on EOS / stop id / length.

        sampled[i] is the token sampled for plan.seqs[i] (None when it did not sample).
        Returns the sequences that got a new token (stop strings are checked by the engine).
        """
        by_id = {s.seq_id: s for s in self.running}
        updated = []
        for item, token in zip(plan.seqs, sampled):
            seq = by_id.get(item.seq_id)
            if seq is None:  # finished (aborted, stopped) while the step ran: its token is discarded
                self._release(item.seq_id)
                continue
            if isinstance(token, list):  # speculative decoding: the verified tokens
                if self._take_verified(seq, item, token):
                    updated.append(seq)
                continue
            seq.num_in_flight -= 1
            seq.num_pending_tokens -= len(item.token_ids)
            seq.num_computed_tokens += len(item.token_ids)
            self.block_manager.cache_computed_blocks(seq)
            if token is None:
                self.num_chunked_prefills += 1
                continue
            seq.num_placeholders -= 1
            seq.append_token(token)
            seq.num_new_tokens = 1
            updated.append(seq)
            reason, stop = self._stop_by_token(seq, token)
            if reason is not None:
                self.finish(seq, reason, stop)
        return updated

    def discard(self, plan: SchedulerOutput) -> None:
        """A plan that will never be postprocessed (its step failed; its requests were finished): its
        sequences leave it, and those it held get their blocks back."""
        for item in plan.seqs:
            self._release(item.seq_id)

    # ------------------------------------------------------------------ internals
    def _plan(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_scheduled_tokens
        input_in_flight = start == len(seq)  # the input is the token the batch in flight samples
        do_sample = start + num_new == len(seq) + seq.num_placeholders
        seq.num_in_flight += 1
        seq.num_pending_tokens += num_new
        seq.num_placeholders += int(do_sample)
        end = start + num_new
        if input_in_flight:
            token_ids = [PLACEHOLDER_TOKEN]
        elif seq.prompt_array is not None and end <= seq.num_prompt_tokens:
            token_ids = seq.prompt_array[start:end]  # a view
        else:
            token_ids = seq.token_ids[start:end]
        return ScheduledSeq(
            seq_id=seq.seq_id, token_ids=token_ids,
            start_pos=start, block_table=list(seq.block_table), do_sample=do_sample,
            params=seq.params if do_sample else None,
            history=seq.token_ids if do_sample and seq.params.has_penalties else None,
            num_prompt_tokens=seq.num_prompt_tokens, input_in_flight=input_in_flight,
        )

    def _plan_verify(self, seq: Sequence, spec) -> ScheduledSeq:
        """Speculative decoding: seq's last token and the proposed tokens spec, sampled at every row (verified)."""
        start = seq.num_scheduled_tokens
        seq.num_in_flight += 1
        seq.num_pending_tokens += 1 + len(spec)
        seq.num_placeholders += 1
        probs = seq.spec_probs
        return ScheduledSeq(
            seq_id=seq.seq_id, token_ids=[seq.token_ids[-1], *spec], start_pos=start, block_table=list(seq.block_table),
            do_sample=True, params=seq.params, history=seq.token_ids if seq.params.has_penalties else None,
            num_prompt_tokens=seq.num_prompt_tokens, spec_token_ids=list(spec),
            spec_probs=None if probs is None else probs[:len(spec)],
        )

    def _take_verified(self, seq: Sequence, item: ScheduledSeq, tokens: List[int]) -> bool:
        """A verify step's tokens for seq (the accepted proposals, then the target's own token): appended up to the
        first that stops it (the rest are cut); the KV of the rejected proposals rolled back (their blocks freed).
        Returns whether a token was appended."""
        seq.num_in_flight -= 1
        seq.num_pending_tokens -= len(item.token_ids)
        seq.num_placeholders -= 1
        reason = stop = None
        num = 0
        for token in tokens:
            seq.append_token(token)
            num += 1
            reason, stop = self._stop_by_token(seq, token)
            if reason is not None:
                break
        seq.num_new_tokens = num
        seq.num_computed_tokens = len(seq) - 1  # the input token and the accepted proposals have their KV
        self.block_manager.truncate(seq, seq.num_computed_tokens)
        self.block_manager.cache_computed_blocks(seq)
        if reason is not None:
            self.finish(seq, reason, stop)
        return num > 0

    def _release(self, seq_id: int) -> None:
        """A finished sequence left a batch in flight; the last one gives its blocks back."""
        seq = self._held.get(seq_id)
        if seq is None:
            return
        seq.num_in_flight -= 1
        if not seq.in_flight:
            del self._held[seq_id]
            self.block_manager.free(seq)

    def _goes_on(self, seq: Sequence) -> bool:
        """Lookahead: may seq, in the batch in flight, be scheduled again? Not when that batch's token
        finishes it by length for sure (its tokens counted with the placeholder)."""
        if not seq.num_placeholders:
            return True  # a prefill chunk in flight: the next chunk is known
        n, max_tokens = len(seq.token_ids) + seq.num_placeholders, seq.params.max_tokens
        return not ((max_tokens is not None and n - seq.num_prompt_tokens >= max_tokens)
                    or n >= self.max_model_len or not self.block_manager.can_ever_fit(n))

    def _num_seated(self) -> int:
        """Running sequences holding a seat under max_num_seqs: with lookahead, one that the batch in flight ends
        by length leaves its seat to the waiting requests (its blocks stay held until that batch is collected)."""
        if not self.lookahead or len(self.running) < self.max_num_seqs:
            return len(self.running)  # a seat is free either way
        return sum(1 for seq in self.running if not seq.in_flight or self._goes_on(seq))

    def _must_wait(self) -> bool:
        """Lookahead: must the batch in flight be postprocessed before this step is scheduled? When the free
        blocks cannot hold the running sequences' next chunks (preempting must see that batch's frees)."""
        bm, budget = self.block_manager, self.max_num_batched_tokens
        # a chunk of n tokens takes at most ceil(n / block_size) new blocks, and the chunks share the budget
        if bm.num_free_blocks >= len(self.running) + bm.blocks_needed(budget):
            return False
        if not any(seq.in_flight for seq in self.running):
            return False
        need = 0
        for seq in self.running:  # the running part of schedule(), counting blocks instead of taking them
            if budget <= 0:
                break
            if seq.in_flight and not self._goes_on(seq):
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            need += max(0, bm.blocks_needed(seq.num_scheduled_tokens + num_new) - len(seq.block_table))
            budget -= num_new
        return need > bm.num_free_blocks

    def _victim(self, seq: Sequence, can_wait: bool) -> Optional[Sequence]:
        """The newest running sequence not in flight; None to wait instead: when that is seq itself (or
        there is none) while batches in flight will bring blocks back."""
        victim = next((s for s in reversed(self.running) if not s.in_flight), None)
        return None if can_wait and victim in (seq, None) else victim

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _stop_by_token(self, seq: Sequence, token: int):
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if len(seq) >= self.max_model_len:
            return "length", None
        if not self.block_manager.can_ever_fit(len(seq)):
            return "length", None  # the whole cache is full of this one sequence
        return None, None

    def _waits_for_leader(self, seq: Sequence) -> bool:
        """An n > 1 sample whose leader has not computed the prompt yet (its KV is not in the cache)."""
        lead = seq.leader
        return (lead is not None and self.block_manager.enable_prefix_caching and not lead.is_finished
                and lead.num_computed_tokens < lead.num_prompt_tokens)

    def admission_error(self, num_tokens: int) -> Optional[str]:
        """Why a prompt of num_tokens can never run here (None: it can)."""
        return self.limits.length_error(num_tokens)
