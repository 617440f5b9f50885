"""LLM.chat: the tokenizer's own chat template (or one given), then generate; bad messages raise before any request."""
from __future__ import annotations

import pytest

from engine_fixtures import checkpoint
from moe_infer import LLM, SamplingParams
from moe_infer.engine.chat_template import ChatTemplateError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONVS = [[{"role": "system", "content": "Python only."}, {"role": "user", "content": "a stack class"}],
         [{"role": "user", "content": "def fib"}]]
OTHER_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                  "{% if add_generation_prompt %}>{% endif %}")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def llm():  # the embedded tiny_moe: its tokenizer has a chat template
    return LLM(device="cpu", dtype="float32", num_kv_blocks=64)


def reference_ids(tok, conv, **kw):
    """The tokenizer's own rendering, tokenized by transformers itself."""
    out = tok.apply_chat_template(conv, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_equals_generate_on_the_templated_prompt(llm):
    tok = llm.get_tokenizer()
    refs = [reference_ids(tok, c, add_generation_prompt=True) for c in CONVS]
    want = llm.generate([{"prompt_token_ids": r} for r in refs], GREEDY, use_tqdm=False)
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "def "}, {"type": "text", "text": "fib"}]}]
    for got in (llm.chat(CONVS, GREEDY, use_tqdm=False), [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in CONVS],
                llm.chat([CONVS[0], as_parts], [GREEDY, GREEDY], use_tqdm=False)):
        assert [o.prompt_token_ids for o in got] == refs
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        assert got[1].prompt == tok.apply_chat_template(CONVS[1], tokenize=False, add_generation_prompt=True)


def test_chat_template_and_generation_prompt_arguments(llm):
    tok = llm.get_tokenizer()
    no_gen = llm.chat(CONVS[0], GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert no_gen.prompt_token_ids == reference_ids(tok, CONVS[0], add_generation_prompt=False)
    assert no_gen.prompt_token_ids != reference_ids(tok, CONVS[0], add_generation_prompt=True)
    other = llm.chat(CONVS[1], GREEDY, use_tqdm=False, chat_template=OTHER_TEMPLATE)[0]
    assert other.prompt == "<user>def fib>"
    assert other.prompt_token_ids == reference_ids(tok, CONVS[1], add_generation_prompt=True,
                                                   chat_template=OTHER_TEMPLATE)


@pytest.mark.parametrize("messages, match", [
    ("hello", "a conversation is a list of"),
    ([], "no messages"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"content": "x"}], r"messages\[0\].role must be a non-empty string"),
    ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text parts"),
    ([{"role": "user", "content": "x", "tool_calls": []}], r"unknown keys \['tool_calls'\]"),
    (["user: x"], r"messages\[0\] must be a dict"),
    ([CONVS[0], [{"role": "user"}]], r"conversation 1: messages\[0\] has no 'content'"),
])
def test_malformed_messages_raise_naming_the_message(llm, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_template_that_fails_and_a_count_mismatch_raise(llm):
    with pytest.raises(ValueError, match="the chat template failed on these messages: .*no assistant here"):
        llm.chat(CONVS[1], GREEDY, use_tqdm=False, chat_template="{{ raise_exception('no assistant here') }}")
    with pytest.raises(ValueError, match="2 sampling params for 1 conversations"):
        llm.chat(CONVS[1], [GREEDY, GREEDY], use_tqdm=False)


def test_a_tokenizer_without_a_template_needs_one_given():
    llm = LLM(model=checkpoint("olmoe", tokenizer=True, vocab_size=100), dtype="float32", device="cpu",
              block_size=4, num_kv_blocks=64)
    assert not getattr(llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ChatTemplateError, match="tokenizer has no chat template: pass chat_template="):
        llm.chat(CONVS[1], GREEDY, use_tqdm=False)
    out = llm.chat(CONVS[1], GREEDY, use_tqdm=False, chat_template=OTHER_TEMPLATE)[0]
    assert out.prompt == "<user>def fib>" and len(out.outputs[0].token_ids) == 8
    bare = LLM(model=checkpoint("qwen3_moe"), dtype="float32", device="cpu", num_kv_blocks=16)
    with pytest.raises(ChatTemplateError, match="chat needs a tokenizer, and this checkpoint has none"):
        bare.chat(CONVS[1], GREEDY, use_tqdm=False, chat_template=OTHER_TEMPLATE)
