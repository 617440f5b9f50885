"""benchmarks/offload.py --smoke: the GPU benchmark's every part, end to end on CPU with tiny shapes
(so the one GPU run does not fail on a typo); the numbers themselves mean nothing here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_offload_benchmark_smoke(tmp_path):
    pytest.importorskip("accelerate")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="2")  # the caller's pool, which --torch-threads overrides
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "offload.py"), "--smoke", "--out",
                           str(tmp_path), "--nvme-path", str(tmp_path), "--torch-threads", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "offload_smoke_cpu.json").read_text())
    runs = sorted((r["shape"], r["routing"], r["streams"], r["prefetch_rule"]) for r in result["runs"])
    assert runs == sorted([(shape, routing, streams, rule) for shape, routing in
                           [("mixtral", "router"), ("mixtral", "trace"), ("qwen3", "router")]
                           for streams, rule in [(1, "saving"), (1, "all"), (16, "saving")]])
    for r in result["runs"]:
        assert r["tok_s"] > 0 and r["needed"] > 0 and 0 <= r["hit_rate"] <= 1
        # the bound at the host's rate timed after the run on the shape's own expert; the limits' rate (a
        # Mixtral expert's) only for the Mixtral shape
        assert r["cpu_ms_after_run"] > 0 and r["step_over_bound_after_run"] > 0
        assert (r["step_over_bound"] is None) == (r["shape"] != "mixtral")
    trace_1 = next(r for r in result["runs"] if r["routing"] == "trace" and r["streams"] == 1)
    assert trace_1["prefetch_token_recall"] > 0.3  # the tiny model's pre-gate, replayed
    for r in result["runs"]:  # the prefetch counters reached the JSON and add up
        assert r["prefetch_wasted"] <= r["prefetched"] and r["gb_prefetch_wasted"] <= r["gb_h2d"]
    assert result["omp_wait_policy"] == "ACTIVE"  # set before torch loads where the caller set none
    assert result["torch_threads"] == 1  # --torch-threads, before the host's first expert (one thread: small shapes)
    assert result["accelerate"]["s_per_token"] > 0
    assert result["nvme"]["read_gbps"] > 0 and result["nvme"]["dd_gbps"] > 0
    assert "shape" in proc.stdout and "wrote" in proc.stdout  # the table and the JSON path are printed
    assert [p.name for p in tmp_path.iterdir()] == ["offload_smoke_cpu.json"]  # NVMe files cleaned up


def test_host_expert_time_leaves_out_the_warm_up(monkeypatch):
    """The limits' CPU figure (the bound's host rate) is timed after warm_s of the same work: a host whose first
    calls run slow (cores waking from idle) is not read as slow, which would loosen the bound."""
    import time

    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import offload_parts

    calls = []

    def swiglu(x, w13, w2):  # the first six calls slow, then fast
        calls.append(None)
        time.sleep(0.02 if len(calls) <= 6 else 0.001)

    monkeypatch.setattr(offload_parts, "swiglu", swiglu)
    ms = offload_parts.host_expert_ms(torch.zeros(8, 4), torch.zeros(4, 4), 1, repeats=4, warm_s=0.15)
    assert ms < 10 and len(calls) > 10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offload_benchmark_expert_graphs_off_and_on(tmp_path):
    """--expert-graphs off,on: each run twice, the device experts through the graphs' static buffers in the second
    (on CPU the same path runs eagerly), the replays counted per run."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "offload.py"), "--smoke", "--out",
                           str(tmp_path), "--torch-threads", "1", "--parts", "mixtral", "--prefetch-rules", "saving",
                           "--expert-graphs", "off,on"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "offload_smoke_cpu.json").read_text())["runs"]
    assert [(r["routing"], r["streams"], r["expert_graphs"]) for r in runs] == [
        (routing, streams, eg) for routing in ("router", "trace") for streams in (1, 16) for eg in (False, True)]
    assert all((r["expert_graph_replays"] > 0) == r["expert_graphs"] for r in runs)
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "offload.py"), "--smoke", "--expert-graphs",
                          "yes"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--expert-graphs" in bad.stderr
