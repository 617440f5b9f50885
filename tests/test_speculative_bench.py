"""benchmarks/speculative.py --tiny: every part of the GPU benchmark, end to end on CPU with small shapes (so the
GPU run does not fail on a typo); the numbers themselves mean nothing here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(900)
def test_speculative_benchmark_tiny(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "speculative.py"), "--tiny", "--out",
                           str(tmp_path), "--batches", "1,4"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "speculative_cpu.json").read_text())
    rows = result["rows"]
    assert {(r["workload"], r["speculation"], r["batch"]) for r in rows} == {
        (w, s, b) for w in ("ngram", "draft", "ngram_large") for s in ("off", "on") for b in (1, 4)}
    for r in rows:
        assert r["decode_tok_s"] > 0
        if r["speculation"] == "off":
            assert r["proposed"] == 0
        else:
            assert r["speedup"] > 0 and 0 <= r["acceptance_rate"] <= 1
    ngram = [r for r in rows if r["workload"] == "ngram" and r["speculation"] == "on"]
    # the repetitive prompts are predicted (8 tokens of the tiny model: a batch's proposals may all be rejected)
    assert all(r["proposed"] > 0 for r in ngram) and any(r["accepted"] > 0 for r in ngram)
    assert all(r["lookahead_steps"] >= 0 and r["drains"] > 0 for r in ngram)  # async scheduling stays on
    assert "speed-up" in proc.stdout  # the table
