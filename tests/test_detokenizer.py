"""Incremental detokenisation against a full decode of the same tokens (the shipped tiny model's
byte-level BPE tokenizer): the streamed pieces add up to `tokenizer.decode(output ids)`, also when the
output ends inside a multi-byte character, and a stop string cuts the text as `str.find` would."""
from __future__ import annotations

import random

import pytest

from moe_infer.assets import default_model_path
from moe_infer.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def incomplete_ids(tok):
    """Ids whose text alone is an incomplete UTF-8 character (the byte-level alphabet's 0x80..0xBF ...)."""
    ids = [i for i in range(len(tok)) if tok.decode([i]).endswith("\ufffd")]
    assert len(ids) >= 64
    return ids


def stream(tok, prompt_ids, out_ids, stop=()):
    detok = IncrementalDetokenizer(tok, prompt_ids, list(stop))
    pieces = []
    for t in out_ids:
        piece, matched = detok.add_token(t)
        pieces.append(piece)
        if matched is not None:
            return "".join(pieces), matched, detok
    piece, matched = detok.flush()
    pieces.append(piece)
    return "".join(pieces), matched, detok


def test_random_ids_add_up_to_the_full_decode(tok, incomplete_ids):
    rng = random.Random(0)
    prompt = tok("héllo wörld ✓ 日本語")["input_ids"]
    ended_incomplete = 0
    for _ in range(300):
        n = rng.randint(1, 12)
        ids = [rng.choice(incomplete_ids) if rng.random() < 0.4 else rng.randrange(len(tok)) for _ in range(n)]
        text, matched, detok = stream(tok, prompt, ids)
        assert matched is None
        assert text == detok.text == tok.decode(ids, skip_special_tokens=True), ids
        ended_incomplete += ids[-1] in incomplete_ids
    assert ended_incomplete >= 50  # the case the flush is for was exercised


def test_multibyte_text_round_trips(tok):
    for s in ["naïve café ✓ 日本語 🙂", "🙂🙂🙂", " ∑ x² ≤ ∞", "plain ascii"]:
        ids = tok(s)["input_ids"]
        text, _, _ = stream(tok, [], ids)
        assert text == tok.decode(ids, skip_special_tokens=True) == s
        for cut in range(1, len(ids)):  # an output cut anywhere, as max_tokens cuts it
            assert stream(tok, [], ids[:cut])[0] == tok.decode(ids[:cut], skip_special_tokens=True)


def test_stop_string_cuts_the_decoded_text(tok):
    ids = tok("alpha beta gamma delta")["input_ids"]
    _, matched, detok = stream(tok, [], ids, stop=["gam"])
    assert (detok.text, matched) == ("alpha beta ", "gam")
    assert "alpha beta ".startswith(detok.stable_text)  # a stream never showed a piece of the stop string
    text, matched, detok = stream(tok, [], ids, stop=["zzz"])
    assert (text, detok.text, matched) == ("alpha beta gamma delta",) * 2 + (None,)


def test_engine_text_is_the_decode_of_its_tokens(tok, incomplete_ids):
    """The engine's final text (the non-streamed response, the last streamed chunk) equals a full decode of
    the output ids, also where the output ends inside a character (held back while streaming)."""
    from moe_infer import LLM, SamplingParams

    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64)
    try:
        params = SamplingParams(max_tokens=3, temperature=100.0, seed=5, ignore_eos=True, n=4)
        outs = llm.generate(["naïve café:", "日本語の", "def f(x):"] * 8, params, use_tqdm=False)
    finally:
        llm.shutdown()
    completions = [c for o in outs for c in o.outputs]
    for c in completions:
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True), c.token_ids
    assert sum(c.token_ids[-1] in incomplete_ids for c in completions) >= 2  # the held-back case happened


def test_backend_decode_equals_the_tokenizers_decode(tok):
    """The detokenizer's fast path (the Rust tokenizer's decode) where transformers' decode adds nothing,
    with special tokens among random ids; a tokenizer that cleans up spaces keeps transformers' decode."""
    import copy

    from moe_infer.engine.detokenizer import backend_decode

    fast = backend_decode(tok)
    assert fast is not None
    rng = random.Random(1)
    specials = list(tok.all_special_ids)
    assert specials
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 8))]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    cleaning = copy.copy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert backend_decode(cleaning) is None
