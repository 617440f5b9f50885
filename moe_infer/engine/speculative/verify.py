"""The verify step's sampling: the target's logits at every proposed token's row -> the tokens each sequence keeps.

A sequence with k proposed tokens has k + 1 sampling rows in the step (its last token, then each proposal:
moe_infer/engine/step_inputs.py). Row j is sampled as the plain step would sample the token at that position: the
request's penalties over its history plus the proposals before row j, min_tokens counted with them, temperature,
top-k/top-p/min-p (`Sampler.target_probs`). `rejection_sample` then keeps the proposals the target accepts and draws
one more token, so the output's distribution is the target's. A sequence without proposals in the step has one row
(k = 0): its token is drawn from p_0, as a plain step draws it.

Random draws: a seeded request's from its own generator (the one its plain steps use), in a fixed order per step
(k uniforms, then one row of exponential noise); the others' from the engine's generator. Logprobs (of the raw
logits, as the plain sampler reports them) come with every emitted token. A step whose rows are all plain greedy
(no logprobs, penalties or min_tokens ban) takes one argmax on the device and matches the prefix on the host
(`GreedyVerified`: the same tokens as rejection sampling's one-hot p, without its [R, V] work).

Legend: R sampling rows of the step (sum of k + 1), B sequences that sample, K their most proposals, V vocabulary.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from moe_infer.engine.sampler import SampledTokens, SampleRequest, Sampler, SamplerOutput
from moe_infer.engine.speculative.rejection import rejection_sample


class VerifiedTokens:
    """A launched verification: per sampling sequence of the plan, its emitted tokens (a list) and their logprobs."""

    def __init__(self, rows: SampledTokens, num_rows_B: List[int]) -> None:
        self.rows, self.num_rows_B = rows, num_rows_B  # rows: the emitted token per row, then num_accepted_B

    def result(self) -> SamplerOutput:
        out = self.rows.result()
        R = sum(self.num_rows_B)
        row_tokens, num_accepted = out.token_ids[:R], out.token_ids[R:]
        tokens, logprobs, at = [], [], 0
        for n_rows, acc in zip(self.num_rows_B, num_accepted):
            tokens.append(row_tokens[at:at + acc + 1])
            lps = out.logprobs[at:at + acc + 1]
            logprobs.append(None if lps[0] is None else list(lps))
            at += n_rows
        return SamplerOutput(tokens, logprobs)


class GreedyVerified:
    """A launched verification of greedy rows without logprobs: the target's argmax per row; the proposals are
    kept while they equal it (prefix matching on the host, where the tokens go anyway), then its argmax follows."""

    def __init__(self, rows: SampledTokens, drafts: List[List[int]]) -> None:
        self.rows, self.drafts = rows, drafts

    def result(self) -> SamplerOutput:
        argmax_R = self.rows.result().token_ids
        tokens, at = [], 0
        for draft in self.drafts:
            out = []
            for j in range(len(draft) + 1):
                out.append(argmax_R[at + j])
                if j == len(draft) or argmax_R[at + j] != draft[j]:
                    break
            tokens.append(out)
            at += len(draft) + 1
        return SamplerOutput(tokens, [None] * len(tokens))


class Verifier:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(self, logits_RV: torch.Tensor, plan) -> VerifiedTokens:
        seqs = [s for s in plan.seqs if s.do_sample]
        reqs: List[SampleRequest] = []
        num_rows_B: List[int] = []
        for s in seqs:
            k = len(s.spec_token_ids)
            num_out = s.start_pos + 1 - s.num_prompt_tokens  # output tokens before row 0's
            for j in range(k + 1):
                history = None if s.history is None else list(s.history) + list(s.spec_token_ids[:j])
                reqs.append(SampleRequest(s.seq_id, s.params, s.num_prompt_tokens, num_out + j, history))
            num_rows_B.append(k + 1)
        R, V = logits_RV.shape
        assert R == len(reqs), f"{R} logit rows for {len(reqs)} verified rows"
        if Sampler.argmax_only(reqs):  # every row greedy, no logprobs, penalties or min_tokens ban: one argmax
            return GreedyVerified(SampledTokens(logits_RV.argmax(-1), None, [None] * R),
                                  [list(s.spec_token_ids) for s in seqs])
        dev, B, K = logits_RV.device, len(seqs), max(num_rows_B) - 1
        target_RV = self.sampler.target_probs(logits_RV, reqs)
        # rows padded to [B, K + 1]: row (b, j) -> R index (padding: the sequence's last row, never read)
        starts = [0]
        for n in num_rows_B:
            starts.append(starts[-1] + n)
        index = [starts[b] + min(j, num_rows_B[b] - 1) for b in range(B) for j in range(K + 1)]
        index_BK1 = torch.tensor(index, dtype=torch.int64).to(dev, non_blocking=True).view(B, K + 1)
        target_BK1V = target_RV[index_BK1]
        draft = [list(s.spec_token_ids) + [0] * (K - len(s.spec_token_ids)) for s in seqs]
        draft_BK = torch.tensor(draft, dtype=torch.int64).view(B, K).to(dev, non_blocking=True)
        num_draft_B = torch.tensor([n - 1 for n in num_rows_B], dtype=torch.int64).to(dev, non_blocking=True)
        draft_BKV = self._draft_probs(seqs, draft_BK, V) if K else None
        uniform_BK, expo_BV = self._noise(seqs, reqs, starts, K, V, dev)
        greedy_B = torch.tensor([s.params.is_greedy for s in seqs]).to(dev, non_blocking=True)
        tokens_BK1, num_accepted_B = rejection_sample(draft_BK, num_draft_B, target_BK1V, draft_BKV, uniform_BK,
                                                      expo_BV, greedy_B)
        # the emitted token of every row (rows past a sequence's accepted ones: unread), then the accepted counts
        row_b = torch.tensor([b for b in range(B) for _ in range(num_rows_B[b])], dtype=torch.int64)
        row_j = torch.tensor([j for b in range(B) for j in range(num_rows_B[b])], dtype=torch.int64)
        tokens_R = tokens_BK1[row_b.to(dev, non_blocking=True), row_j.to(dev, non_blocking=True)]
        num_lp = [r.params.logprobs for r in reqs]
        logprobs = None
        if any(n is not None for n in num_lp):
            logprobs = Sampler._logprobs(torch.log_softmax(logits_RV.float(), -1), tokens_R, num_lp)
        return VerifiedTokens(SampledTokens(torch.cat([tokens_R, num_accepted_B]), logprobs,
                                            num_lp + [None] * B), num_rows_B)

    @staticmethod
    def _draft_probs(seqs, draft_BK: torch.Tensor, V: int) -> Optional[torch.Tensor]:
        """q_BKV: the draft's probabilities where it gave them, one-hot at the proposal elsewhere; None when no
        sequence has them (every proposal deterministic)."""
        if all(s.spec_probs is None for s in seqs):
            return None
        q_BKV = torch.zeros(*draft_BK.shape, V, device=draft_BK.device).scatter_(2, draft_BK.unsqueeze(2), 1.0)
        for b, s in enumerate(seqs):
            if s.spec_probs is not None:
                q_BKV[b, :len(s.spec_token_ids)] = s.spec_probs.float()
        return q_BKV

    def _noise(self, seqs, reqs: List[SampleRequest], starts: List[int], K: int, V: int, dev: torch.device):
        """(uniform_BK, expo_BV): a seeded request's from its own generator, the rest from the engine's."""
        B = len(seqs)
        gen = self.sampler.generator
        uniform_BK = torch.rand(B, K, device=dev, generator=gen)
        expo_BV = torch.empty(B, V, device=dev).exponential_(generator=gen)
        for b, s in enumerate(seqs):
            if s.params.seed is not None and not s.params.is_greedy:
                own = self.sampler.generator_of(reqs[starts[b]])
                k = len(s.spec_token_ids)  # as many draws as its own proposals: not the batch's K
                uniform_BK[b, :k] = torch.rand(k, device=dev, generator=own)
                expo_BV[b].exponential_(generator=own)
        return uniform_BK, expo_BV
