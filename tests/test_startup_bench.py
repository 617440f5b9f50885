"""benchmarks/startup.py: a cold and a warm start, each a fresh process, timed in parts that fit in the whole; the cold
start begins with an empty Triton cache (on a GPU the warm one finds the kernels the cold one compiled)."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the engine's parts every start times (moe_infer/engine/startup_timings.py); on CUDA cuda_init_s too
PARTS = ("parallel_init_s", "plugins_s", "transformers_import_s", "hf_config_s", "model_load_s", "kv_cache_s",
         "kernel_warmup_s", "cuda_graphs_s", "tokenizer_s", "scheduler_s")


def _run(tmp_path, *args):
    out = tmp_path / "startup.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "startup.py"), *args, "--out", str(out)],
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "to_first_token" in proc.stdout and "warm" in proc.stdout  # the table
    return json.loads(out.read_text())


def _check_parts(result):
    assert [r["kind"] for r in result["runs"]] == ["cold", "warm"]
    for r in result["runs"]:
        assert r["tokens"] == 16 and r["first_request_ttft_s"] > 0
        assert set(PARTS) <= set(r["engine_parts"]), r["engine_parts"]
        assert all(r[p] is not None and r[p] >= 0 for p in r["engine_parts"] + ["interpreter_s", "imports_s",
                                                                               "engine_other_s"])
        assert sum(r[p] for p in r["engine_parts"]) + r["engine_other_s"] == pytest.approx(r["engine_s"])
        # the parts cover the engine: what none of them times is a small rest (LLM()'s config, the engine's fields)
        assert r["engine_other_s"] <= 0.05 * r["engine_s"] + 0.1, r
        assert r["interpreter_s"] + r["imports_s"] + r["engine_s"] <= r["to_first_token_s"] + 0.05, r
        assert r["to_first_token_s"] <= r["interpreter_s"] + r["imports_s"] + r["engine_s"] + r["first_request_s"] + 0.5
    assert result["runs"][0]["triton_cache_files_at_start"] == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_startup_tiny_on_cpu(tmp_path):
    result = _run(tmp_path, "--tiny")
    assert result["device"] == "cpu" and result["met"] is None  # no targets off the GPU
    _check_parts(result)


@pytest.mark.gpu
@pytest.mark.timeout(1500)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_startup_on_the_gpu(tmp_path):
    result = _run(tmp_path)
    _check_parts(result)
    cold, warm = result["runs"]
    assert cold["kernel_warmup_s"] > 0 and cold["cuda_graphs_s"] > 0 and cold["cuda_init_s"] > 0
    assert warm["triton_cache_files_at_start"] > 0  # the cold start's compiled kernels
    assert set(result["met"]) == {"cold", "warm"}  # reported, not asserted: targets are the benchmark's business
