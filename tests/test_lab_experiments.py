"""Every lab experiment config runs on CPU on the tiny model at small sizes; the CF sweep's counts are the
routing policy's own; the lab stays out of `import moe_infer` and never imports the engine."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra", reason="the lab's experiment configs need hydra-core")
pytest.importorskip("matplotlib", reason="the lab's figures need matplotlib (the lab extra)")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from moe_infer.launch import CONF_DIR, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL_DATA = ["lab.data.num_windows=2", "lab.data.seq_len=32", "lab.data.windows_per_forward=2"]
SMALL_SYNTHETIC = ["lab.synthetic.num_experts=16", "lab.synthetic.top_k=2", "lab.synthetic.num_layers=2",
                   "lab.synthetic.num_steps=8", "lab.synthetic.tokens_per_step=64"]


def _job(experiment, out, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}", f"lab.out_dir={out}", *overrides])
    return OmegaConf.to_object(cfg)


def test_lab_is_not_imported_by_moe_infer_and_never_imports_the_engine():
    code = "import sys, moe_infer; sys.exit(any(m.startswith(('moe_infer.lab', 'moe_infer.experiments')) for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode == 0
    for path in (ROOT / "moe_infer" / "lab").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith(("moe_infer.engine", "moe_infer.experiments")) for n in names), (path, names)


@pytest.mark.timeout(300)
def test_record_and_synthetic_trace(tmp_path):
    from moe_infer.routing.trace import load_trace

    trace = run(_job("record_trace", tmp_path / "rec", *SMALL_DATA))
    assert trace.num_tokens == 64 and trace.num_layers == 6
    back = load_trace(str(tmp_path / "rec" / "trace.safetensors"))
    assert (back.topk_ids_LTK == trace.topk_ids_LTK).all() and back.info["prompts"]["data"]["seq_len"] == 32
    assert (tmp_path / "rec" / "load_heatmap.png").stat().st_size > 1000
    syn = run(_job("synthetic_trace", tmp_path / "syn", "lab.synthetic.pattern=bursty", *SMALL_SYNTHETIC))
    assert load_trace(str(tmp_path / "syn" / "trace.safetensors")).num_tokens == syn.num_tokens == 512
    assert "![load_heatmap.png]" in (tmp_path / "syn" / "report.md").read_text()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("policy,drop_by", [("drop", "position"), ("drop", "score"), ("reroute", "position")])
def test_cf_sweep_counts_are_the_policys_own(tmp_path, policy, drop_by):
    """The job's dropped / rerouted counts (the engine's load statistics in the policy run) equal the
    policy replayed on the router choices recorded in that run, layer by layer and expert by expert."""
    from moe_infer.lab.capacity import replay_policy
    from moe_infer.routing.trace import load_trace

    row = run(_job("cf_sweep", tmp_path, f"routing.policy={policy}", f"routing.drop_by={drop_by}",
                   "routing.capacity_factor=0.75", "routing.min_capacity=2", "lab.sweep.save_trace=true", *SMALL_DATA,
                   "lab.data.num_windows=4"))  # two forwards: two policy calls per layer
    trace = load_trace(str(tmp_path / "policy_trace.safetensors"))
    assert trace.step_T.max() == 1
    replay = replay_policy(trace, policy, 0.75, 2, drop_by)
    for layer, stats in enumerate(row["stats"]):
        for key in ("routed", "dropped", "rerouted"):
            assert replay[key][layer].tolist() == stats[key], (layer, key)
    assert row["dropped_frac"] + row["rerouted_frac"] > 0
    assert 0 < row["kl"] and 0 < row["top1_agreement"] < 1 and row["ppl"] > 0
    table = json.loads((tmp_path / "cf_sweep.json").read_text())
    assert len(table) == 1 and table[0]["capacity_factor"] == 0.75


@pytest.mark.timeout(600)
def test_cf_sweep_multirun_writes_one_table(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "moe_infer.launch", "--multirun", "+experiment=cf_sweep", "routing=drop",
           "routing.min_capacity=0", "routing.capacity_factor=0.5,8.0",
           f"hydra.sweep.dir={sweep}", *SMALL_DATA]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((sweep / "cf_sweep.json").read_text())
    assert [r["capacity_factor"] for r in rows] == [0.5, 8.0]  # 8 = E / K: capacity = T, nothing can drop
    assert rows[0]["dropped_frac"] > rows[1]["dropped_frac"] == 0.0 and rows[1]["kl"] < 1e-9
    assert (sweep / "cf_curves.png").is_file() and (sweep / "dropless_reference.pt").is_file()
    assert (sweep / "cf_sweep.csv").read_text().splitlines()[0].startswith("policy,drop_by,capacity_factor")
    assert "| drop | position |" in (sweep / "report.md").read_text()


@pytest.mark.timeout(300)
def test_eplb_simulate_and_report(tmp_path, capsys):
    from moe_infer.parallel.placement import load_placement

    rows = run(_job("eplb", tmp_path / "eplb", "lab.eplb.num_gpus=[2,8]", "lab.traces=[example,synthetic:zipf]",
                    *SMALL_SYNTHETIC))
    assert {r["trace"] for r in rows} == {"tiny_moe", "synthetic_zipf"}
    files = sorted((tmp_path / "eplb" / "placements").glob("*.json"))
    assert len(files) == 4
    for f in files:
        ep = int(f.stem.split("_N")[1].split("_")[0])
        assert load_placement(str(f), 16, ep).ep == ep
    contiguous = {(r["trace"], r["num_gpus"]): r["imbalance_mean"] for r in rows if r["planner"] == "contiguous"}
    for r in rows:
        if r["planner"] == "eplb" and r["num_redundant"] > 0:
            assert r["imbalance_planned_on"] <= contiguous[(r["trace"], r["num_gpus"])]
    sim = run(_job("simulate", tmp_path / "sim", "lab.simulate.num_gpus=[1,8]", "lab.simulate.num_steps=2",
                   "lab.simulate.tokens_per_gpu=16", "lab.traces=[example,synthetic:drifting]", *SMALL_SYNTHETIC))
    policies = {(r["trace"], r["num_gpus"], r["policy"]) for r in sim}
    assert ("tiny_moe", 8, "eplb_online+1") in policies and ("synthetic_drifting", 8, "cf=1.25") in policies
    assert all(r["step_us"] > 0 for r in sim)
    printed = capsys.readouterr().out
    for task, folder, names in (("eplb", "eplb", ("eplb.csv", "imbalance_vs_replicas.png", "placements/")),
                                ("simulate", "sim", ("simulate.csv", "step_time_vs_gpus.png", "report.md"))):
        line = next((ln for ln in printed.splitlines() if ln.startswith(f"{task} -> ")), None)
        assert line and line.startswith(f"{task} -> {tmp_path / folder}: "), (task, printed[-2000:])
        listed = line.split(": ", 1)[1].split(", ")
        assert set(names) <= set(listed) and all((tmp_path / folder / n).exists() for n in listed), line
    calib = json.loads((tmp_path / "sim" / "calibration.json").read_text())
    assert calib and all(0.8 < (c.get("layer_ratio") or c["ratio"]) < 1.2 for c in calib)
    page = run(_job("lab_report", tmp_path, "lab.report_dirs=[eplb,sim]"))
    text = Path(page).read_text()
    assert "![imbalance_vs_replicas.png](eplb/imbalance_vs_replicas.png)" in text
    assert "![step_time_vs_gpus.png](sim/step_time_vs_gpus.png)" in text


def test_bad_lab_config_names_the_field(tmp_path):
    with pytest.raises(Exception, match="lab.traces"):
        _job("eplb", tmp_path, "lab.traces=[nonsense]")
    with pytest.raises(Exception, match="task="):
        _job("eplb", tmp_path, "task=nope")
    with pytest.raises(Exception, match="lab.simulate.tokens_per_gpu"):
        _job("simulate", tmp_path, "lab.simulate.tokens_per_gpu=0")
