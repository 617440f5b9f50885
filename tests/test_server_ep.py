"""`moe-infer serve` under torchrun (EP=2; gloo on CPU, NCCL on two GPUs): rank 0 serves HTTP, rank 1 runs its
steps; an idle server outlives the collective timeout (ranks idle on the control group); SIGTERM to rank 0 drains
and every rank exits 0. Across two "nodes" (two torchrun launches, c10d rendezvous) likewise."""
from __future__ import annotations

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
from tests.dist.launch import worker_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(360)]
PROMPT = "def fibonacci(n):"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank0_pid(parent: int) -> int:
    """The worker of torchrun `parent` whose environment says RANK=0."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == parent and b"RANK=0" in env:
            return int(pid)
    raise AssertionError("no rank-0 worker found")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server process exited with {proc.returncode}:\n{proc.stdout.read()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not come up")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torchrun_serves_on_the_driver_and_exits_cleanly(device):
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    port = free_port()
    env = worker_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "moe_infer.launch", "serve", "parallel=ep", "parallel.ep=2", "parallel.timeout_s=8",
           f"model.device={device}", "model.dtype=float32", "cache.num_kv_blocks=64", "scheduler.max_num_seqs=4",
           f"--port={port}", "--log-level", "info"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny_moe", prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        ref = LLM(device=device, dtype="float32", num_kv_blocks=64).generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        assert r.choices[0].text == ref.outputs[0].text
        time.sleep(12)  # idle past parallel.timeout_s: rank 1 waits for the next step without a timeout
        chunks = list(client.chat.completions.create(model="tiny_moe", messages=[{"role": "user", "content": "x"}],
                                                     n=2, max_tokens=6, stream=True, seed=1))
        assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 2
        os.kill(rank0_pid(proc.pid), signal.SIGTERM)  # as a user stops the server: rank 0 drains, releases rank 1
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    assert out.count("Uvicorn running on") == 1 and "address already in use" not in out, out[-4000:]


def test_serve_across_two_nodes_through_c10d_rendezvous():
    """Two "machines" (one torchrun each, --nnodes 2, c10d rendezvous on localhost) serve one EP=2 engine:
    exactly one HTTP server (global rank 0) answers as the offline engine does; SIGTERM to it ends both nodes
    with exit 0."""
    port, rdzv = free_port(), free_port()
    env = worker_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=localhost:{rdzv}", f"--rdzv-id=serve{rdzv}", "-m", "moe_infer.launch", "serve",
           "parallel=ep", "parallel.ep=2", "model.device=cpu", "model.dtype=float32", "cache.num_kv_blocks=64",
           "scheduler.max_num_seqs=4", f"--port={port}", "--log-level", "info"]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    url = f"http://127.0.0.1:{port}"
    outs = []
    try:
        deadline = time.monotonic() + 180
        while True:  # either node may get global rank 0: wait on whichever serves
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            dead = [n.returncode for n in nodes if n.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"no server came up (exits {dead}):\n" + "\n".join(
                n.stdout.read()[-3000:] for n in nodes if n.poll() is not None)
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny_moe", prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        ref = LLM(device="cpu", dtype="float32", num_kv_blocks=64).generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        assert r.choices[0].text == ref.outputs[0].text
        driver = []
        for n in nodes:
            try:
                driver.append(rank0_pid(n.pid))
            except AssertionError:
                pass
        assert len(driver) == 1, f"global rank 0 found under {len(driver)} nodes"
        os.kill(driver[0], signal.SIGTERM)
        outs = [n.communicate(timeout=120)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.communicate()
    log = "\n".join(outs)
    assert [n.returncode for n in nodes] == [0, 0], log[-6000:]
    assert log.count("Uvicorn running on") == 1, log[-6000:]
