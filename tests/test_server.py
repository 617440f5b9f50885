"""The OpenAI-compatible server through the official `openai` client, over a real uvicorn server on loopback.

References are independent of the server: transformers' greedy generate and its logprobs for the
tokens, the tokenizer's own chat template for the prompt, and n=1 requests for n > 1.
"""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine_fixtures import hf_greedy  # noqa: E402
from server_fixtures import MODEL, live_server  # noqa: E402

from moe_infer.assets import default_model_path  # noqa: E402

PROMPT = "def fibonacci(n):"
IGNORE_EOS = {"ignore_eos": True}
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def srv():
    with live_server(serve=dict(max_n=4, max_queued_requests=16)) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(srv):
    return srv.engine.tokenizer


def test_greedy_completion_equals_transformers(client, tokenizer, srv):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=IGNORE_EOS,
                                  logprobs=2)
    ids = tokenizer(PROMPT)["input_ids"]
    ref, ref_lp = hf_greedy(default_model_path(), ids, 12)
    choice = r.choices[0]
    assert choice.text == tokenizer.decode(ref) and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12 and r.usage.total_tokens == len(ids) + 12
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL and r.created > 1.6e9
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ref]
    assert lp.token_logprobs == pytest.approx([float(ref_lp[i, t]) for i, t in enumerate(ref)], abs=2e-3)
    assert all(len(top) >= 2 and max(top.values()) == pytest.approx(v, abs=1e-6)  # greedy: the chosen is the top
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    srv.wait_idle()


def test_echo_returns_the_prompt_sent_as_text_or_as_ids(client, tokenizer):
    """echo=True: the prompt's text, then the completion; a prompt sent as ids is decoded by the server (the engine
    keeps no text for id prompts, as vLLM)."""
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body=IGNORE_EOS)
    plain = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    ids = tokenizer(PROMPT)["input_ids"]
    as_text = client.completions.create(prompt=PROMPT, echo=True, **kw).choices[0].text
    as_ids = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    assert as_text == PROMPT + plain
    assert as_ids == tokenizer.decode(ids) + plain
    assert client.completions.create(prompt=ids, **kw).choices[0].text == plain  # no echo: the completion alone


def test_chat_uses_the_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "Python only."}, {"role": "user", "content": "a stack class"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                       extra_body=IGNORE_EOS, logprobs=True, top_logprobs=2)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ref, ref_lp = hf_greedy(default_model_path(), ids, 10)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == tokenizer.decode(ref)
    assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([float(ref_lp[i, t]) for i, t in enumerate(ref)], abs=2e-3)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert bytes(content[0].bytes).decode() == content[0].token


def test_streams_with_usage_equal_the_whole_answer(client):
    kw = dict(model=MODEL, max_tokens=14, temperature=0, extra_body=IGNORE_EOS)
    whole = client.completions.create(prompt=PROMPT, **kw)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    messages = [{"role": "user", "content": "import os"}]
    whole = client.chat.completions.create(messages=messages, **kw)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_samples_equal_seeded_single_requests(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body=IGNORE_EOS)
    many = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.usage.completion_tokens == 24
    alone = [client.completions.create(seed=11 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == alone and len(set(alone)) > 1
    chunks = list(client.completions.create(n=2, seed=11, stream=True, **kw))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert [texts[0], texts[1]] == alone[:2]
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "import os"], n=2, max_tokens=4, temperature=0,
                                      extra_body=IGNORE_EOS)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.choices[0].text == batch.choices[1].text


def test_seed_reproduces_and_differs_by_seed(client):
    kw = dict(model=MODEL, max_tokens=10, temperature=1.0, top_p=0.9, extra_body=IGNORE_EOS)
    a = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], seed=5, **kw)
    b = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], seed=5, **kw)
    c = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], seed=6, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content != c.choices[0].message.content


def test_stop_strings_cut_the_text_streamed_or_not(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=IGNORE_EOS)
    base = client.completions.create(**kw).choices[0].text
    stop = base[6:9]
    first = base.find(stop)
    r = client.completions.create(stop=[stop, "never-there"], **kw).choices[0]
    assert r.finish_reason == "stop" and r.text == base[:first] and r.model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == base[:first]


@pytest.mark.parametrize("body,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(n=9), "n"), (dict(logprobs=50), "logprobs"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=5000), "max_tokens"), (dict(stop=[""]), "stop"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(best_of=3), "best_of"), (dict(prompt=[]), "prompt"),
    (dict(prompt=[[1, 2], [99999]]), "prompt"), (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(prompt="x " * 2000), "prompt"), (dict(prompt=""), "prompt"), (dict(presence_penalty=3), "presence_penalty"),
])
def test_bad_requests_are_400_naming_the_field(client, body, field):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4)
    kw.update(body)
    prompt = kw.pop("prompt")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt=prompt, **kw)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == field and err["type"] == "invalid_request_error", err


def test_other_errors_keep_openai_shape(client, srv):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="max_model_len is 1024|maximum context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y " * 1100}], max_tokens=2)
    r = httpx.post(f"{srv.base_url}/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{srv.base_url}/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(f"{srv.url}/nope").json()["error"]["code"] == 404


def test_models_health_version_and_metrics(client, srv):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert httpx.get(f"{srv.url}/version").json()["version"]
    for _ in range(2):  # 2 full blocks of 16 come from the prefix cache the second time
        client.completions.create(model=MODEL, prompt=PROMPT * 6, max_tokens=3, extra_body=IGNORE_EOS)
    text = httpx.get(f"{srv.url}/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name, **labels):
        return samples[(f"moe_infer:{name}", tuple(sorted(labels.items())))]

    assert value("time_to_first_token_seconds_count") >= 1 and value("e2e_request_latency_seconds_count") >= 1
    assert value("requests_finished_total", finished_reason="length") >= 1
    assert value("num_kv_blocks") == 128 and value("num_kv_blocks_used") == 0
    assert value("prefix_cache_queries_total") >= value("prefix_cache_hits_total") >= 2
    load = srv.utility("stats")[1]
    assert [value("expert_routed_tokens_total", layer="0", expert=str(e)) for e in range(16)] == load[0]["routed"]
    assert sum(load[0]["routed"]) > 0 and value("expert_load_imbalance", layer="5") == load[5]["imbalance"]
    assert value("num_requests_running") == 0 and value("num_preemptions_total") >= 0
