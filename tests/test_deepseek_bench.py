"""benchmarks/deepseek_v3.py runs end to end on the CPU (tiny widths): the attention rows agree with the PyTorch
path, the engine rows and the rooflines are there."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_tiny_run_writes_every_part(tmp_path):
    out = tmp_path / "ds.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "deepseek_v3.py"), "--tiny", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["attention"]) == 4 and all(a["max_abs_diff"] < 1e-4 for a in result["attention"])
    assert set(result["engine"]) == {"bf16", "fp8"} and set(result["fp8_decode_speedup"]) == {"1", "2"}
    for eng in result["engine"].values():
        assert [d["batch"] for d in eng["decode"]] == [1, 2] and all(d["tok_s"] > 0 for d in eng["decode"])
        assert eng["prefill"]["tok_s"] > 0 and eng["kv_bytes_per_token"] == 4 * (32 + 16) * 4  # 4 layers, fp32
    assert "MLA decode attention" in proc.stdout


@pytest.mark.timeout(300)
def test_tiny_fp8_engine_with_an_fp8_latent_cache(tmp_path):
    """--formats fp8 --kv-cache-dtype fp8: the fp8 checkpoint format with an e4m3 latent cache (1 byte a value)."""
    out = tmp_path / "ds.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "deepseek_v3.py"), "--tiny",
                           "--skip-attention", "--formats", "fp8", "--kv-cache-dtype", "fp8", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    eng = json.loads(out.read_text())["engine"]["fp8"]
    assert all(d["tok_s"] > 0 for d in eng["decode"]) and eng["kv_bytes_per_token"] == 4 * (32 + 16)
