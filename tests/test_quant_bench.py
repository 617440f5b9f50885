"""The quantization benchmarks' CPU smoke runs (--tiny): every format's row is written, each format's output is close
to the bf16 path on its dequantized weights, the perplexities are those of a model that predicts."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _run(script, out, interpret):
    env = dict(os.environ, PYTHONPATH=ROOT, **({"TRITON_INTERPRET": "1"} if interpret else {}))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--tiny", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.timeout(600)
def test_quant_moe_tiny(tmp_path):
    result = _run("quant_moe.py", tmp_path / "q.json", interpret=True)
    rows = result["rows"]
    assert {(r["format"], r["tokens"]) for r in rows} == {(f, t) for f in ("bf16", "fp8", "int4", "mxfp4")
                                                          for t in (1, 5)}
    assert result["hbm_bytes_per_s"] > 0 and all(r["us"] > 0 and r["roofline_us"] > 0 for r in rows)
    # fp8 quantizes the activations too (W8A8); the 4-bit formats only round the intermediate to bf16
    assert all(r["rel_err"] <= (0.06 if r["format"] == "fp8" else 0.02) for r in rows), rows


@pytest.mark.timeout(600)
def test_quant_e2e_tiny(tmp_path):
    result = _run("quant_e2e.py", tmp_path / "e.json", interpret=False)
    assert {(r["format"], r["batch"]) for r in result["speed"]} == {(f, b) for f in ("bf16", "fp8", "int4")
                                                                   for b in (1, 2)}
    ppl = {r["format"]: r["ppl"] for r in result["ppl"]}
    base = result["ppl"][0]["format"]  # the unquantized model, named by its dtype (the CPU's: float32)
    assert base == "float32" and set(ppl) == {base, "fp8", "int4"}, ppl
    assert all(1.0 < p < 6144 / 4 for p in ppl.values()), ppl  # far below a uniform guess over the vocabulary
    assert abs(ppl["fp8"] / ppl[base] - 1) < 0.05 and abs(ppl["int4"] / ppl[base] - 1) < 0.25, ppl
