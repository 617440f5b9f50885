"""Speculative decoding: a proposer guesses tokens, one step of the target model verifies them.

    Speculator (speculator.py)   before each schedule: how many tokens to propose (adaptive k), which sequences,
                                 the proposer's guesses on `Sequence.spec_token_ids`; after each step: the counts
    proposers (ngram.py, draft.py) PROPOSERS: "ngram" (prompt lookup), "draft" (a small model); "mtp" is named
                                 and refused until DeepSeek-V3's MTP layers are loaded
    Verifier (verify.py)         the verify step's sampling: rejection sampling (rejection.py) of the proposals

The scheduler schedules a sequence's last token plus its proposals (k + 1 query tokens) and rolls the KV blocks of
rejected proposals back when the step is postprocessed (moe_infer/engine/scheduler.py); docs/speculative.md.
"""
