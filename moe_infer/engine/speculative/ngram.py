"""The n-gram (prompt lookup) proposer: no model. The sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) are looked up among its earlier tokens (prompt and output); at the latest earlier occurrence of
the longest n that occurs, the tokens that followed it are proposed. Repetitive work (editing or quoting the prompt,
code, structured text) is where it pays.

Proposals are deterministic (q one-hot in the rejection test). Host-only: numpy over each sequence's tokens.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from moe_infer.engine.sequence import Sequence


def ngram_propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> List[int]:
    """k tokens that followed the latest earlier occurrence of the longest suffix of tokens of length in
    [min_n, max_n] (where the tokens end before k of them, the text from that occurrence on is taken as repeating:
    its continuation is the repetition); [] when none occurs."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:L - 1], n)  # windows starting at 0..L-1-n (not the suffix itself)
        hits = np.flatnonzero((windows == tokens[L - n:]).all(1))
        if hits.size:
            start = int(hits[-1]) + n
            out = tokens[start:start + k].tolist()
            period = L - start  # the suffix recurs this far after its match: past the end, the text repeats so
            while len(out) < k:
                out.append(out[len(out) - period])
            return out
    return []


class NgramProposer:
    def __init__(self, cfg, **_) -> None:
        self.min_n, self.max_n = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.proposal_cost = 0.0  # host work only (adaptive k's prior, cost.py)
        self.can_fill = True  # deterministic proposals: a short one may be filled up to k (speculator.py)

    def propose(self, seqs: List[Sequence], num_tokens: List[int]) -> None:
        """Sets seq.spec_token_ids (at most num_tokens[i] tokens) and seq.spec_probs (None: one-hot)."""
        for seq, k in zip(seqs, num_tokens):
            seq.spec_token_ids = ngram_propose(np.asarray(seq.token_ids, dtype=np.int64), k, self.min_n, self.max_n)
            seq.spec_probs = None

    def may_propose(self, tokens: np.ndarray) -> bool:
        """Whether a suffix of tokens (a sequence's tokens before its last one) recurs among them: with async
        scheduling, whether the engine drains the step in flight to verify (speculator.py)."""
        return bool(ngram_propose(tokens, 1, self.min_n, self.max_n))

    def max_tokens(self, seq: Sequence) -> Optional[int]:
        return None  # no limit of its own
