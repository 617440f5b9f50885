"""The cost model and the cluster simulator: calibration reproduced, EP benchmark checked, routing counted."""
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_infer.lab.calibration_check import ep_rows, single_gpu_rows
from moe_infer.lab.cost_model import ExpertCurve, calibrate, expected_active, fit_curve
from moe_infer.lab.eplb import Plan, plan_eplb
from moe_infer.lab.loads import expert_load
from moe_infer.lab.simulate import SimConfig, capacity_keep, layer_loads, simulate
from moe_infer.lab.synthetic import SyntheticSpec, generate
from moe_infer.routing.capacity import CAPACITY_POLICIES
from moe_infer.routing.spec import RoutingSpec

RESULTS = str(Path(__file__).resolve().parents[1] / "benchmarks" / "results")
SHAPES = ("qwen3-30b-a3b", "deepseek-v3")


@pytest.fixture(scope="module", params=SHAPES)
def cost(request):
    return calibrate(RESULTS, request.param, "H200")


def test_one_gpu_cluster_reproduces_the_measurements_it_was_calibrated_on(cost):
    rows = single_gpu_rows(cost, RESULTS)
    assert len(rows) >= 4
    for r in rows:  # a uniform synthetic trace at the benchmark's token count, on one simulated GPU
        assert r["ratio"] == pytest.approx(1.0, abs=0.03), r


def test_simulator_against_the_ep_benchmark(cost):
    """2 GPUs: the all-to-all was fitted there; 4 GPUs: a check (not fitted). Layer = dispatch +
    experts + combine, each within 10 % of the measured graph times at every token count."""
    rows = ep_rows(cost, RESULTS)
    assert {r["gpus"] for r in rows} == {2, 4} and len(rows) == 8
    for r in rows:
        assert r["layer_ratio"] == pytest.approx(1.0, abs=0.10), r
        assert r["simulated_experts_us"] == pytest.approx(r["measured_experts_us"], rel=0.10), r


def test_curve_and_link_pieces():
    curve = fit_curve([(8, 8, 30.0), (50, 64, 140.0), (128, 1024, 300.0), (128, 8192, 600.0)])
    for A, R, t in [(8, 8, 30.0), (50, 64, 140.0), (128, 1024, 300.0), (128, 8192, 600.0)]:
        assert float(curve.time_us(A, R)) == pytest.approx(t)
    assert float(ExpertCurve(10.0, [1, 2], [1.0, 3.0]).time_us(4, 16)) == pytest.approx(10 + 4 * 7.0)  # slope 2
    assert float(expected_active(128, 8, 1)) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="no calibration"):
        calibrate(RESULTS, "no-such-model")


def test_capacity_keep_is_the_engines_drop_policy_per_source_gpu():
    rng = np.random.default_rng(0)
    T, K, E, B = 64, 2, 8, 16
    ids = np.stack([rng.choice(E, K, replace=False, p=np.r_[0.4, [0.6 / 7] * 7]) for _ in range(T)])
    for cap in (2, 4, 7):
        keep = capacity_keep(ids, B, E, cap)
        for g in range(T // B):
            mine = torch.from_numpy(ids[g * B:(g + 1) * B]).int()
            kept, _ = CAPACITY_POLICIES.get("drop")(mine, torch.ones(B, K), spec=RoutingSpec(num_experts=E, top_k=K),
                                                    capacity_factor=cap * E / (B * K), min_capacity=0, backend="torch")
            assert (keep[g * B:(g + 1) * B] == (kept >= 0).numpy()).all()


def test_layer_loads_by_hand():
    """2 GPUs of 2 slots (experts 0,1 | 2,3); GPU 0 routes tokens 0-1, GPU 1 tokens 2-3 (top-1)."""
    ids = np.array([[0], [2], [3], [3]])
    cfg = SimConfig(num_gpus=2, tokens_per_gpu=2)
    out = layer_loads(ids, np.arange(4), cfg, 4, gpus_per_node=8)
    assert out["rows"].tolist() == [1, 3] and out["active"].tolist() == [1, 2]
    assert out["intra_out"].tolist() == [1, 0] and out["intra_in"].tolist() == [0, 1]
    assert out["inter_out"].sum() == 0
    out = layer_loads(ids, np.arange(4), cfg, 4, gpus_per_node=1)  # one GPU per node: the row crosses nodes
    assert out["inter_out"].tolist() == [1, 0] and out["intra_out"].sum() == 0
    # a replicated expert: 3 in slots 1 and 3 (GPU 0 and GPU 1); rows alternate by (row + source GPU)
    out = layer_loads(ids, np.array([0, 3, 2, 3]), SimConfig(num_gpus=2, tokens_per_gpu=2), 4, gpus_per_node=8)
    assert out["rows"].tolist() == [2, 2]


def test_balance_shows_in_the_step_time(cost):
    spec = dict(num_experts=64, top_k=8, num_layers=2, num_steps=4, tokens_per_step=2048)
    uniform = generate(SyntheticSpec(pattern="uniform", **spec))
    zipf = generate(SyntheticSpec(pattern="zipf", zipf_s=0.8, **spec))
    cfg = SimConfig(num_gpus=16, tokens_per_gpu=128, num_steps=2)
    even = simulate(uniform, cost, cfg)
    skew = simulate(zipf, cost, cfg)
    assert even["straggler_share"] < 0.15 < skew["straggler_share"] and skew["step_us"] > even["step_us"]
    plan = plan_eplb(expert_load(zipf), 16, 16)
    balanced = simulate(zipf, cost, cfg, plan)
    assert balanced["step_us"] < skew["step_us"] and balanced["straggler_share"] < skew["straggler_share"]
    dropped = simulate(zipf, cost, SimConfig(num_gpus=16, tokens_per_gpu=128, num_steps=2, capacity_factor=1.0,
                                             dispatcher="capacity"))
    assert dropped["dropped_frac"] > 0.05 and dropped["step_us"] < skew["step_us"]
    with pytest.raises(ValueError, match="plan is for"):
        simulate(zipf, cost, cfg, Plan(plan.phy2log_LP, 64, 8))
