"""Prompt text to token ids, for every place a request's text is tokenized (engine, engine core client, server, chat).

transformers warns "Token indices sequence length is longer than the specified maximum sequence length for this
model" when a text tokenizes past the tokenizer's `model_max_length`. Here the length is the engine's business: a
prompt longer than max_model_len fails alone with an error naming the limit (prompt_limits.py), and where
`model_max_length` differs from max_model_len the warning is wrong. `verbose=False` is the tokenizer's own switch
for that warning (nothing is truncated either way); transformers' other logging is left alone.
"""
from __future__ import annotations

from typing import List


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> List[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])
