"""benchmarks/mesh_scaling.py end to end on CPU (gloo, tiny dims, 2 processes): every layout runs through the engine
and the table's figures are there, so the script works before a multi-GPU machine is lent."""
import json
import os
import subprocess
import sys

import pytest

from tests.dist.launch import ROOT, worker_env

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def test_mesh_scaling_runs_every_layout_on_cpu(tmp_path):
    out = tmp_path / "mesh_scaling.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "mesh_scaling.py"), "--tiny", "--models",
                           "small", "--out", str(out)], cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["models"]["small"]["rows"]
    assert list(rows) == ["one GPU", "mesh x1", "tp=2", "ep=2", "pp=2", "tp=2 ep=2", "ep=2 dp"]
    for name, row in rows.items():
        assert row["gpus"] == (1 if name in ("one GPU", "mesh x1") else 2), name
        for b in ("1", "4"):
            d = row["decode"][b]
            assert d["tok_s"] > 0 and d["roofline_tok_s"] > 0 and d["vs_one_gpu"] > 0, (name, d)
            assert d["step_ms"] >= 0 and d["comm_ms_est"] >= 0, (name, d)
        assert row["prefill"]["tok_s"] > 0, name
        if row["gpus"] > 1:  # the raw collectives of the same run, at every decode batch
            raw = row["raw"]["1"]
            assert ("all_reduce_s" in raw) == (row["tp"] > 1 or row["ep"] > 1), (name, raw)
            assert ("p2p_s" in raw) == (row["pp"] > 1), (name, raw)
    assert rows["one GPU"]["decode"]["1"]["runs"] == rows["mesh x1"]["decode"]["1"]["runs"] == 2  # A B B A
