"""Quality cost of a routing policy against dropless, on the same inputs.

Per position t of held-out text (logits after token t predict token t+1):
  kl          KL(p_dropless || p_policy) of the next-token distributions, nats, mean over positions
  top1        share of positions where both pick the same most likely token
  ppl         perplexity exp(mean NLL of the actual next token), for the policy and for dropless
The last position of each window has no next token in the window: it counts for KL and top-1
but not for perplexity. Accumulated in float64 over batches.

Legend: T positions, V vocabulary.
"""
from __future__ import annotations

import math
from typing import Dict

import torch


class QualityMeter:
    def __init__(self) -> None:
        self.kl_sum = self.top1_sum = self.nll_ref = self.nll_test = 0.0
        self.num_positions = self.num_targets = 0

    def update(self, ref_logits_TV: torch.Tensor, test_logits_TV: torch.Tensor, targets_T: torch.Tensor) -> None:
        """targets_T: the next token of each position, -1 where there is none."""
        if ref_logits_TV.shape != test_logits_TV.shape or targets_T.shape != ref_logits_TV.shape[:1]:
            raise ValueError(f"logits {tuple(ref_logits_TV.shape)} / {tuple(test_logits_TV.shape)} and targets "
                             f"{tuple(targets_T.shape)} must agree")
        ref_TV = torch.log_softmax(ref_logits_TV.double(), -1)
        test_TV = torch.log_softmax(test_logits_TV.double(), -1)
        self.kl_sum += float((ref_TV.exp() * (ref_TV - test_TV)).sum())
        self.top1_sum += float((ref_TV.argmax(-1) == test_TV.argmax(-1)).sum())
        self.num_positions += ref_TV.shape[0]
        has_T = targets_T >= 0
        tgt_T = targets_T.clamp_min(0)[:, None]
        self.nll_ref -= float(ref_TV.gather(1, tgt_T).squeeze(1)[has_T].sum())
        self.nll_test -= float(test_TV.gather(1, tgt_T).squeeze(1)[has_T].sum())
        self.num_targets += int(has_T.sum())

    def result(self) -> Dict[str, float]:
        n, m = max(self.num_positions, 1), max(self.num_targets, 1)
        return {"kl": self.kl_sum / n, "top1_agreement": self.top1_sum / n,
                "ppl": math.exp(self.nll_test / m), "ppl_dropless": math.exp(self.nll_ref / m),
                "positions": self.num_positions}


def next_token_targets(windows_WQ) -> torch.Tensor:
    """int64 [W*Q]: token t+1 of each window position, -1 at the window's last position."""
    w = torch.as_tensor(windows_WQ)
    tgt = torch.full_like(w, -1)
    tgt[:, :-1] = w[:, 1:]
    return tgt.reshape(-1)
