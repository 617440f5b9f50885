"""Admission control and the request lifecycle over a real server: API key, body limit, a burst past the
queue (429 + Retry-After, every accepted request completes), client disconnects (KV blocks freed at
once), graceful shutdown (in-flight streams finish)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

openai = pytest.importorskip("openai")
import httpx  # noqa: E402
from server_fixtures import MODEL, live_server  # noqa: E402

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def srv():
    with live_server(serve=dict(api_key=KEY, max_queued_requests=2, max_request_bytes=4096, retry_after_s=2),
                     max_num_seqs=2) as s:
        yield s


def body(max_tokens: int, **kw) -> dict:
    return dict(model=MODEL, prompt="def f(x):", max_tokens=max_tokens, ignore_eos=True, **kw)


def test_api_key_guards_v1_only(srv):
    for key in ("wrong", KEY + "x", KEY[:-1]):
        client = openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    ok = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    out = ok.completions.create(model=MODEL, prompt="def f(x):", max_tokens=2, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert httpx.get(f"{srv.url}/health").status_code == 200 and httpx.get(f"{srv.url}/metrics").status_code == 200
    r = httpx.post(f"{srv.base_url}/completions", json=body(2))
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_body_limit_with_and_without_content_length(srv):
    big = json.dumps(body(2, stop=["x" * 5000])).encode()
    r = httpx.post(f"{srv.base_url}/completions", content=big, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]

    def chunks():  # chunked transfer: no Content-Length to refuse up front
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    r = httpx.post(f"{srv.base_url}/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413
    srv.wait_idle()


def test_burst_past_the_queue_gets_429_and_the_rest_complete(srv):
    async def burst():
        async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=120) as client:
            return await asyncio.gather(*(client.post("/completions", json=body(24)) for _ in range(12)))

    replies = asyncio.run(burst())
    codes = [r.status_code for r in replies]
    assert set(codes) == {200, 429} and codes.count(200) >= 4, codes  # 2 running + 2 queued at least
    for r in replies:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "2" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 24
    text = httpx.get(f"{srv.url}/metrics").text
    assert f'moe_infer:requests_rejected_total{{reason="queue_full"}} {codes.count(429)}.0' in text
    srv.wait_idle()


def test_stream_disconnect_aborts_and_frees_blocks(srv):
    with httpx.stream("POST", f"{srv.base_url}/completions", json=body(900, stream=True), headers=AUTH,
                      timeout=60) as r:
        lines = r.iter_lines()
        seen = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert len(seen) >= 2 and srv.blocks_used() > 0
    srv.wait_idle(timeout=10)  # the abort reached the engine: every block is free again
    assert srv.state().num_running == 0


def test_non_stream_disconnect_aborts_too(srv):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.base_url}/completions", json=body(900), headers=AUTH, timeout=1.5)
    srv.wait_idle(timeout=10)
    text = httpx.get(f"{srv.url}/metrics").text
    assert 'moe_infer:requests_finished_total{finished_reason="abort"}' in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine_loop", ["process", "thread"])
def test_shutdown_drains_in_flight_streams(engine_loop):
    with live_server(serve=dict(drain_timeout_s=60, engine_loop=engine_loop)) as s:
        with httpx.stream("POST", f"{s.base_url}/completions", json=body(40, stream=True), timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            s.server.should_exit = True  # as SIGTERM: stop accepting, let open requests finish
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
        assert len([first] + rest) >= 3
        deadline = time.monotonic() + 30
        while s.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not s.thread.is_alive() and not s.engine.is_running
