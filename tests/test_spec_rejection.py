"""Rejection sampling of proposed tokens (moe_infer/engine/speculative/rejection.py) keeps the target's distribution.

Many independent rows of one small-vocabulary case run at once (the function is vectorised over rows): the first
emitted token must follow p_0, the token after an accepted first proposal p_1 (chi-square, fixed seeds), with a
drawn draft (q from a distribution) and with a one-hot draft (n-gram); the acceptance rate of a one-hot draft is
p_0 at the proposal. Without the residual step (a rejection drawing from p instead of norm(max(0, p - q))) the first
token's distribution is off and the test fails (p-values ~1e-300 with that bug put back). Greedy rows reduce to prefix
matching. The reference is the algorithm's statement (the target distributions themselves), not the code.
"""
from __future__ import annotations

import pytest
import torch

from moe_infer.engine.speculative.rejection import rejection_sample

pytestmark = pytest.mark.timeout(120)
V, N = 6, 60_000  # vocabulary, rows (samples)


def _case(seed: int, one_hot_draft: bool):
    gen = torch.Generator().manual_seed(seed)
    p_K1V = torch.softmax(torch.randn(3, V, generator=gen) * 1.5, -1)  # p_0, p_1, p_2
    q_KV = torch.softmax(torch.randn(2, V, generator=gen) * 1.5, -1)  # the draft's q_1, q_2
    if one_hot_draft:  # a deterministic proposer: the same two proposals every time
        draft_NK = torch.tensor([[2, 4]]).expand(N, 2).clone()
        draft_NKV = None
    else:
        draft_NK = torch.stack([torch.multinomial(q_KV[j], N, replacement=True, generator=gen) for j in range(2)], 1)
        draft_NKV = q_KV.unsqueeze(0).expand(N, 2, V)
    uniform_NK = torch.rand(N, 2, generator=gen)
    expo_NV = torch.empty(N, V).exponential_(generator=gen)
    target_NK1V = p_K1V.unsqueeze(0).expand(N, 3, V)
    tokens, num_acc = rejection_sample(draft_NK, torch.full((N,), 2), target_NK1V, draft_NKV, uniform_NK, expo_NV)
    return p_K1V, draft_NK, tokens, num_acc


def _chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of the counts against probs: P(chi2_{V-1} >= statistic)."""
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64), stat / 2).item()


@pytest.mark.parametrize("one_hot_draft", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_tokens_follow_the_target(seed, one_hot_draft):
    p, draft, tokens, num_acc = _case(seed, one_hot_draft)
    assert _chi2_pvalue(tokens[:, 0], p[0]) > 1e-3  # the first token: p_0
    second = num_acc >= 1  # the first proposal was kept: the next token follows p_1
    assert (tokens[second, 0] == draft[second, 0]).all()
    assert _chi2_pvalue(tokens[second, 1], p[1]) > 1e-3
    # acceptance as the algorithm says: P(accept d_1) = sum_x min(p_0(x), q_1(x)); one-hot at 2: p_0(2)
    if one_hot_draft:
        assert abs(second.double().mean().item() - p[0, 2].item()) < 0.01


def test_greedy_rows_are_prefix_matching():
    # p one-hot at 3, 1, 5, 0: proposals [3, 1, 2] keep 3 and 1, then emit 5 (the target's argmax) at the mismatch
    p = torch.zeros(1, 4, V)
    p[0, torch.arange(4), torch.tensor([3, 1, 5, 0])] = 1.0
    for draft, want in (([3, 1, 2], [3, 1, 5]), ([3, 1, 5], [3, 1, 5, 0]), ([0, 1, 5], [3])):
        tokens, num_acc = rejection_sample(torch.tensor([draft]), torch.tensor([3]), p, None, torch.rand(1, 3),
                                           torch.empty(1, V).exponential_(), torch.tensor([True]))
        assert tokens[0, :num_acc[0] + 1].tolist() == want
    # fewer proposals than the padded width: the bonus comes from p at the row after the last real one
    tokens, num_acc = rejection_sample(torch.tensor([[3, 1, 0]]), torch.tensor([1]), p, None, torch.rand(1, 3),
                                       torch.empty(1, V).exponential_(), torch.tensor([True]))
    assert tokens[0, :num_acc[0] + 1].tolist() == [3, 1]


def test_adaptive_k():
    """k from the measured acceptance and the batch size, before any step time is measured (the prior cost model:
    moe_infer/engine/speculative/cost.py; measured costs: tests/test_spec_cost.py)."""
    from moe_infer.config import EngineConfig, SpeculativeConfig
    from moe_infer.engine.speculative.cost import PROBE_EVERY
    from moe_infer.engine.speculative.speculator import Speculator

    cfg = EngineConfig(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                     disable_by_batch_size=32))
    spec = Speculator(cfg, None, None, max_model_len=1024)
    spec.acceptance = 0.9
    assert spec.choose_k(1) == 4  # often right, small batch: the most
    assert spec.choose_k(32) == spec.choose_k(100) == 0  # from disable_by_batch_size on: off
    assert 0 < spec.choose_k(24) < 4  # a larger batch: fewer
    spec.acceptance = 0.3
    assert spec.choose_k(1) < 4
    spec.acceptance = 0.0  # never right: no speculation but the probes
    spec.num_steps = 1
    assert spec.choose_k(1) == 0
    spec.num_steps = PROBE_EVERY
    assert spec.choose_k(1) == 1
    spec.acceptance, spec.num_steps = 0.6, 1
    spec.proposer.proposal_cost = 1.0  # a draft as costly as the target: not worth it at 0.6
    assert spec.choose_k(1) == 0
    spec.proposer.proposal_cost = 0.0
    assert spec.choose_k(1) > 0
    fixed = Speculator(EngineConfig(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                  adaptive=False)), None, None, 1024)
    fixed.acceptance = 0.0
    assert fixed.choose_k(1) == 3 and fixed.choose_k(32) == 0
