"""Speculative decoding: a proposer guesses tokens, one step of the target model verifies them.

    Speculator (speculator.py)   before each schedule: how many tokens to propose (adaptive k from measured step
                                 times, cost.py), which sequences, the proposer's guesses on `Sequence.spec_token_ids`;
                                 after each step: the counts and the step's time
    proposers                    PROPOSERS: "ngram" (ngram.py: prompt lookup), "draft" (draft.py: a small model),
                                 "mtp" (mtp.py: DeepSeek-V3's multi-token-prediction layer)
    Verifier (verify.py)         the verify step's sampling: rejection sampling (rejection.py) of the proposals
    verify graphs (graphs.py)    which verify steps the decode CUDA graphs replay (k + 1 tokens every sequence)

The scheduler schedules a sequence's last token plus its proposals (k + 1 query tokens) and rolls the KV blocks of
rejected proposals back when the step is postprocessed (moe_infer/engine/scheduler.py); docs/speculative.md.
"""
