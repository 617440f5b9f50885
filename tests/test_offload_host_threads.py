"""The offload host threads' wait policy (moe_infer/host_threads.py): which engines want OpenMP threads
that stay awake between layers, that the processes the engine starts get OMP_WAIT_POLICY=ACTIVE (a user's own
policy kept, the parent's environment restored), and that a server's engine core with spinning threads leaves
cores to the API server processes."""
from __future__ import annotations

import multiprocessing.context
import os
import subprocess
import sys

import pytest

from moe_infer.config import EngineConfig, ModelConfig, OffloadConfig
from moe_infer.engine import core_spawn
from moe_infer.engine.core_proc import needs_cores_left
from moe_infer import host_threads

pytestmark = pytest.mark.timeout(120)
VAR = "OMP_WAIT_POLICY"
THREADS = "OMP_NUM_THREADS"


def test_which_engines_want_awake_host_threads(monkeypatch):
    monkeypatch.setattr(host_threads, "host_cores", lambda: 16)
    cpu = OffloadConfig(store="cpu")
    active = {VAR: "ACTIVE", THREADS: "15"}  # the pool leaves the main thread a core
    assert host_threads.wanted_env(cpu, "cuda", {}) == active
    for miss in ("auto", "cpu", "share"):
        assert host_threads.wanted_env(OffloadConfig(store="cpu", miss_policy=miss), "cuda", {}) == active
    assert host_threads.wanted_env(cpu, "cuda", {}, reserved_cores=2) == {VAR: "ACTIVE", THREADS: "13"}  # 2 servers
    assert host_threads.wanted_env(cpu, "cuda", {THREADS: "8"}) == {VAR: "ACTIVE"}  # the user's count stands
    monkeypatch.setattr(host_threads, "host_cores", lambda: 2)
    assert host_threads.wanted_env(cpu, "cuda", {}, reserved_cores=3) == {VAR: "ACTIVE", THREADS: "1"}
    assert host_threads.wanted_env(cpu, "cuda", {VAR: "PASSIVE"}) == {}  # the user's choice stands
    assert host_threads.wanted_env(OffloadConfig(store="cpu", miss_policy="wait"), "cuda", {}) == {}  # no host misses
    assert host_threads.wanted_env(OffloadConfig(), "cuda", {}) == {}  # resident
    assert host_threads.wanted_env(OffloadConfig(store="nvme", nvme_path="/tmp"), "cuda", {}) == {}
    assert host_threads.wanted_env(cpu, "cpu", {}) == {}  # a CPU engine: the host computes everything


def test_device_type_of_a_model_device_setting():
    assert host_threads.device_type_of("auto", True) == "cuda"
    assert host_threads.device_type_of("auto", False) == "cpu"
    assert host_threads.device_type_of("cuda:1", False) == "cuda"
    assert host_threads.device_type_of("cpu", True) == "cpu"


def test_cuda_present_without_torch(monkeypatch):
    monkeypatch.setattr(host_threads.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert host_threads.cuda_present({})
    assert host_threads.cuda_present({"CUDA_VISIBLE_DEVICES": "0,1"})
    assert not host_threads.cuda_present({"CUDA_VISIBLE_DEVICES": ""})
    assert not host_threads.cuda_present({"CUDA_VISIBLE_DEVICES": "-1"})
    monkeypatch.setattr(host_threads.os.path, "exists", lambda path: False)
    assert not host_threads.cuda_present({})


def test_start_up_note_only_where_threads_sleep():
    cpu = OffloadConfig(store="cpu")
    note = host_threads.start_up_note(cpu, "cuda", {})
    assert note is not None and f"{VAR}=ACTIVE {THREADS}=" in note and f"{VAR}=unset" in note
    assert VAR + "=PASSIVE" in host_threads.start_up_note(cpu, "cuda", {VAR: "PASSIVE"})
    assert host_threads.start_up_note(cpu, "cuda", {VAR: "active"}) is None
    assert host_threads.start_up_note(cpu, "cpu", {}) is None
    assert host_threads.start_up_note(OffloadConfig(), "cuda", {}) is None


def _child_policy(var: str = VAR) -> str:
    out = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get('{var}', 'unset'))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def test_spawn_env_reaches_the_child_and_leaves_the_parent_as_it_was(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.delenv(THREADS, raising=False)
    monkeypatch.setattr(host_threads, "host_cores", lambda: 8)
    with host_threads.spawn_env(OffloadConfig(store="cpu"), "cuda", reserved_cores=1) as added:
        assert added == {VAR: "ACTIVE", THREADS: "6"} and _child_policy() == "ACTIVE" and _child_policy(THREADS) == "6"
    assert VAR not in os.environ and THREADS not in os.environ and _child_policy() == "unset"
    monkeypatch.setenv(VAR, "PASSIVE")
    with host_threads.spawn_env(OffloadConfig(store="cpu"), "cuda") as added:
        assert added == {} and _child_policy() == "PASSIVE"
    assert os.environ[VAR] == "PASSIVE"


@pytest.mark.parametrize("store,expected", [("cpu", ("ACTIVE", "13")), ("resident", (None, None))])
def test_the_server_core_starts_with_the_policy(monkeypatch, store, expected):
    """CoreProcess (the server's engine core): the environment its process is started with, captured at start():
    with the policy a pool that leaves a core to the main thread and one to each of the 2 API servers."""
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.delenv(THREADS, raising=False)
    monkeypatch.setattr(host_threads, "host_cores", lambda: 16)
    seen = []
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start",
                        lambda self: seen.append((os.environ.get(VAR), os.environ.get(THREADS))))
    cfg = EngineConfig(model=ModelConfig(device="cuda"), offload=OffloadConfig(store=store))
    core_spawn.CoreProcess(cfg, "unused", num_clients=2)
    assert seen == [expected] and VAR not in os.environ and THREADS not in os.environ


def test_an_engine_core_with_spinning_threads_leaves_cores_to_the_servers():
    assert needs_cores_left("cuda", {VAR: "ACTIVE"})
    assert not needs_cores_left("cuda", {})
    assert not needs_cores_left("cuda", {VAR: "PASSIVE"})
    assert needs_cores_left("cpu", {})
    assert not needs_cores_left("cuda", {VAR: "ACTIVE", "OMP_NUM_THREADS": "8"})  # the user chose


def test_the_engine_core_leaves_cores_before_the_engine_starts(monkeypatch):
    """run_engine_core sets the thread count before the engine is built: the offload cost model runs the host's
    experts at start-up, and a libgomp pool made smaller after that may keep its extra threads spinning (a core
    each) under OMP_WAIT_POLICY=ACTIVE (a pool of 2 made 1 did here), so a count set after the build may leave no
    core to the servers."""
    import signal

    import torch
    from multiprocessing import Pipe

    from moe_infer.engine import core_proc, llm_engine

    monkeypatch.setenv(VAR, "ACTIVE")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the core's own handlers: not in the test process
    before = torch.get_num_threads()
    seen = []

    class Engine:
        def __init__(self, *a, **k):
            seen.append(torch.get_num_threads())
            raise RuntimeError("stop here")

    monkeypatch.setattr(llm_engine, "LLMEngine", Engine)
    commands, results = [Pipe(duplex=False) for _ in range(2)], [Pipe(duplex=False) for _ in range(2)]
    clients = [(cmd_r, res_w) for (cmd_r, _), (_, res_w) in zip(commands, results)]  # two API servers
    try:
        torch.set_num_threads(4)
        core_proc.run_engine_core(EngineConfig(model=ModelConfig(device="cpu")), "unused", clients, 30)
        assert seen == [2]
        assert results[0][0].recv() == ("start_failed", "RuntimeError: stop here")
    finally:
        torch.set_num_threads(before)
