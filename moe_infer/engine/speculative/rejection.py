"""Rejection sampling of proposed tokens: the output keeps the target model's distribution exactly.

Per sequence b with k_b proposed tokens d_1..d_k (drawn from q_1..q_k) and the target's distributions p_0..p_k
(p_j: of the token after d_j; p_0 after the sequence's last token), the standard algorithm (Leviathan et al.,
Chen et al., 2023):
    for j = 1..k: accept d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j)); at the first rejection, emit a
    token drawn from norm(max(0, p_{j-1} - q_j)) (the residual) and stop;
    all k accepted: emit a bonus token drawn from p_k.
So 1..k+1 tokens are emitted. A deterministic proposer (n-gram, a greedy draft) has a one-hot q; a greedy request a
one-hot p, which makes this prefix matching: the proposals are kept while they equal the target's argmax, then the
argmax follows.

Pure tensor code, no engine import; the random draws come in as arguments (uniforms for the acceptance tests,
exponentials for the draws: argmax(r / E), E ~ Exp(1), draws from r in proportion), so that the caller decides which
generator (a seeded request's own) each row's draws come from.

Legend: B sequences, K the most proposed tokens of a sequence (rows padded), V vocabulary.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def rejection_sample(draft_BK: torch.Tensor, num_draft_B: torch.Tensor, target_BK1V: torch.Tensor,
                     draft_BKV: Optional[torch.Tensor], uniform_BK: torch.Tensor, expo_BV: torch.Tensor,
                     greedy_B: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens_BK1: row b's emitted tokens are tokens_BK1[b, :num_accepted_B[b] + 1], num_accepted_B).

    draft_BK int64: proposed tokens (entries past num_draft_B[b]: any valid id); target_BK1V: p_0..p_K, normalised;
    draft_BKV: q_1..q_K (None: one-hot at the proposals); uniform_BK in [0, 1); expo_BV: Exp(1) noise of the one
    token drawn per row (residual or bonus); greedy_B: rows whose token is p's argmax (p one-hot)."""
    B, K = draft_BK.shape
    pos_K = torch.arange(K, device=draft_BK.device)
    p_draft_BK = target_BK1V[:, :K].gather(2, draft_BK.unsqueeze(2)).squeeze(2)
    q_draft_BK = (torch.ones_like(p_draft_BK) if draft_BKV is None
                  else draft_BKV.gather(2, draft_BK.unsqueeze(2)).squeeze(2))
    accept_BK = (uniform_BK * q_draft_BK < p_draft_BK) & (pos_K.unsqueeze(0) < num_draft_B.unsqueeze(1))
    num_accepted_B = accept_BK.to(torch.int64).cumprod(1).sum(1)
    rows_B = torch.arange(B, device=draft_BK.device)
    p_BV = target_BK1V[rows_B, num_accepted_B]  # the distribution after the accepted proposals
    rejected_B = num_accepted_B < num_draft_B
    at_B = num_accepted_B.clamp_max(max(K - 1, 0))
    if K == 0:
        q_BV = torch.zeros_like(p_BV)
    elif draft_BKV is None:
        q_BV = torch.zeros_like(p_BV).scatter_(1, draft_BK[rows_B, at_B].unsqueeze(1), 1.0)
    else:
        q_BV = draft_BKV[rows_B, at_B]
    residual_BV = (p_BV - q_BV).clamp_min(0.0)
    # a residual of no mass (p == q up to rounding: a rejection of probability 0) falls back to p
    has_mass_B = residual_BV.sum(1) > 0
    dist_BV = torch.where((rejected_B & has_mass_B).unsqueeze(1), residual_BV, p_BV)
    token_B = (dist_BV / expo_BV).argmax(1)
    if greedy_B is not None:
        token_B = torch.where(greedy_B, dist_BV.argmax(1), token_B)
    tokens_BK1 = torch.cat([draft_BK, draft_BK.new_zeros(B, 1)], 1)
    tokens_BK1[rows_B, num_accepted_B] = token_B
    return tokens_BK1, num_accepted_B
