"""`moe-infer serve serve.api_server_count=2`: two HTTP processes on one socket in front of one engine core (CPU,
the shipped tiny model, a real launcher process). Every response is its own prompt's greedy continuation (the
core routes each request's outputs to the process that added it), both processes serve, the request limit is
shared (a burst held open admits exactly max_num_seqs + max_queued_requests), /metrics from either process
counts both, SIGTERM drains and stops everything with exit code 0, and a dead engine core stops the server
with a non-zero code."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("hydra")
import httpx  # noqa: E402

from moe_infer import LLM, SamplingParams  # noqa: E402
from moe_infer.assets import default_model_path  # noqa: E402
from tests.test_server_ep import free_port, wait_healthy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(300)
PROMPTS = [f"def f{i}(x):" for i in range(12)]
MAX_TOKENS = 6
LIMIT = dict(max_num_seqs=2, max_queued_requests=2)


class Launcher:
    def __init__(self, tmp_path, *overrides: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_dir = tmp_path / "metrics"
        self.metrics_dir.mkdir()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                   PROMETHEUS_MULTIPROC_DIR=str(self.metrics_dir), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "moe_infer.server", "serve.api_server_count=2", f"serve.port={self.port}",
               "serve.served_model_name=tiny", "serve.log_level=warning", "serve.drain_timeout_s=20",
               "model.dtype=float32", "model.device=cpu", *overrides]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        wait_healthy(self.url, self.proc, timeout)

    def children(self):
        """pids of the processes the launcher started (engine core, API servers; not multiprocessing's resource
        tracker), from /proc."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if ppid == self.proc.pid and b"resource_tracker" not in cmdline:
                found.append(int(pid))
        return found

    def core_pid(self) -> int:
        """The child without a socket: the API servers share the listening one, the engine core has none."""
        cores = []
        for pid in self.children():
            links = []
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
            if not any(link.startswith("socket:") for link in links):
                cores.append(pid)
        assert len(cores) == 1, cores
        return cores[0]

    def log(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        return self.proc.stdout.read()[-4000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def greedy():
    llm = LLM(model=default_model_path(), device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_two_processes_serve_one_engine(tmp_path, greedy):
    server = Launcher(tmp_path, f"scheduler.max_num_seqs={LIMIT['max_num_seqs']}",
                      f"serve.max_queued_requests={LIMIT['max_queued_requests']}")
    try:
        server.wait_healthy()
        children = server.children()
        assert len(children) == 3, children  # the engine core and two API servers

        async def fresh_connection(prompt: str, stream: bool):
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:  # a new connection each
                body = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
                if not stream:
                    r = await client.post("/v1/completions", json=body)
                    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                text = ""
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"] if r.status_code == 200 else ""
                return r.status_code, text

        async def waves():  # at most 4 at once: the limit is 4, so none is refused
            results = []
            for start in range(0, len(PROMPTS), 4):
                results += await asyncio.gather(*(fresh_connection(p, stream=i % 2 == 0)
                                                  for i, p in enumerate(PROMPTS[start:start + 4], start)))
            return results

        for _ in range(2):
            replies = asyncio.run(waves())
            assert [code for code, _ in replies] == [200] * len(PROMPTS), replies
            assert [text for _, text in replies] == greedy
        # both processes served: each writes its own multiprocess metric files, named by its pid
        served_by = {f.stem.rsplit("_", 1)[1] for f in server.metrics_dir.glob("histogram_*.db")}
        assert len(served_by) == 2, served_by
        for _ in range(6):  # whichever process answers the scrape counts every request
            text = httpx.get(f"{server.url}/metrics").text
            assert metric(text, 'moe_infer:requests_finished_total{finished_reason="length"}') == 2 * len(PROMPTS)
            assert metric(text, "moe_infer:time_to_first_token_seconds_count") == 2 * len(PROMPTS)

        # a burst of streams held open: exactly max_num_seqs + max_queued_requests are admitted across both
        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                         limits=httpx.Limits(max_connections=32)) as client:
                body = dict(model="tiny", prompt="def g(x):", max_tokens=400, ignore_eos=True, stream=True)
                ctxs = [client.stream("POST", "/v1/completions", json=body) for _ in range(12)]
                responses = await asyncio.gather(*(c.__aenter__() for c in ctxs))
                codes = [r.status_code for r in responses]
                in_flight = [metric(httpx.get(f"{server.url}/metrics").text, "moe_infer:num_requests_in_flight")
                             for _ in range(4)]
                for c in ctxs:
                    await c.__aexit__(None, None, None)  # a disconnect: the admitted ones are aborted
                return codes, in_flight

        codes, in_flight = asyncio.run(burst())
        admitted = sum(LIMIT.values())
        assert codes.count(200) == admitted and codes.count(429) == 12 - admitted, codes
        assert in_flight == [admitted] * 4, in_flight
        deadline = time.monotonic() + 20
        while metric(httpx.get(f"{server.url}/metrics").text, "moe_infer:num_kv_blocks_used") and \
                time.monotonic() < deadline:
            time.sleep(0.2)  # the aborts reached the core: every block is free again
        text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, "moe_infer:num_kv_blocks_used") == 0 and metric(text, "moe_infer:num_requests_in_flight") == 0
        assert metric(text, 'moe_infer:requests_rejected_total{reason="queue_full"}') == 12 - admitted
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in children), "a process outlived the launcher"


def test_a_dead_engine_core_stops_the_server(tmp_path):
    server = Launcher(tmp_path)
    try:
        server.wait_healthy()
        children = server.children()
        os.kill(server.core_pid(), signal.SIGKILL)  # as the out-of-memory killer would
        code = server.proc.wait(60)
    finally:
        server.stop()
    assert code != 0
    assert "the engine core (exit code -9) stopped on its own" in server.log()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in children)


def test_a_taken_port_is_a_clear_error():
    from moe_infer.server.multi import reserve_port

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            reserve_port("127.0.0.1", port)
