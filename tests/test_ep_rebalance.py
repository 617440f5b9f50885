"""Online expert re-balancing under EP (torchrun, gloo, 2 and 4 ranks): experts move between ranks while
the engine serves, and greedy outputs equal the engine without re-balancing."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from ep_rebalance_worker import CASES  # noqa: E402
from tests.dist.launch import torchrun  # noqa: E402

from moe_infer.experiments.common import EXAMPLE_TRACE  # noqa: E402
from moe_infer.lab.eplb import plan_auto  # noqa: E402
from moe_infer.lab.loads import expert_load  # noqa: E402
from moe_infer.lab.plan_eval import model_wide_plan, write_placement  # noqa: E402
from moe_infer.parallel.placement import (ExpertPlacement, load_layer_placements,  # noqa: E402
                                          replicate_hot_experts)
from moe_infer.routing.trace import load_trace  # noqa: E402
from moe_infer.parallel.rebalance import copy_schedule  # noqa: E402


def test_copy_schedule_prefers_local_copies_and_spreads_sends():
    old = ExpertPlacement(4, 2, ((0, 1, 3), (2, 3, 0)))
    new = ExpertPlacement(4, 2, ((1, 0, 2), (3, 2, 1)))
    sched = copy_schedule(old, new)
    # rank 0: slot 0 <- its own slot 1 (expert 1), slot 1 <- its own slot 0 (0), slot 2 <- rank 1 (2)
    # rank 1: slot 0 <- its own slot 1 (3), slot 1 <- its own slot 0 (2), slot 2 <- rank 0 slot 1 (1)
    assert sched == [(0, 0, 0, 1), (0, 1, 0, 0), (0, 2, 1, 0), (1, 0, 1, 1), (1, 1, 1, 0), (1, 2, 0, 1)]
    assert copy_schedule(old, old) == []


def test_local_moves_read_every_source_before_writing():
    import torch

    from moe_infer.parallel.rebalance import move_weights

    w13, w2 = torch.arange(6.0).view(3, 2), torch.arange(3.0).view(3, 1) * 10
    old = ExpertPlacement(3, 1, ((0, 1, 2),))
    new = ExpertPlacement(3, 1, ((1, 2, 0),))  # a rotation: every source slot is also overwritten
    assert move_weights([w13, w2], copy_schedule(old, new), rank=0, group=None) == 3
    assert w13.tolist() == [[2.0, 3.0], [4.0, 5.0], [0.0, 1.0]] and w2.view(-1).tolist() == [10.0, 20.0, 0.0]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [2, 4])
def test_rebalancing_moves_experts_and_keeps_greedy_outputs(nproc, tmp_path):
    _rebalancing_run(nproc, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [2, 4])
def test_rebalancing_on_gpus_nccl(nproc, tmp_path):
    """The same on one GPU a rank over NCCL (the weights move by NCCL sends between steps)."""
    import torch

    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA devices, found {torch.cuda.device_count()}")
    _rebalancing_run(nproc, tmp_path, "cuda")


def _rebalancing_run(nproc, tmp_path, device):
    out = tmp_path / "tokens.json"
    placement_file = str(tmp_path / "placement.json")
    trace = load_trace(str(EXAMPLE_TRACE))  # the planner's per-layer file, from the shipped trace
    load = expert_load(trace)
    write_placement(placement_file, plan_auto(load, nproc, nproc), model_wide_plan(load, nproc, nproc),
                    layer_ids=trace.moe_layers)
    rc, log = torchrun(nproc, "ep_rebalance_worker.py", str(out), placement_file, "--device", device, timeout=540)
    assert rc == 0 and "EP REBALANCE DONE" in log, log[-4000:]
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == [list(c) for c in CASES]
    for r in results:
        assert r["tokens_eplb"] == r["tokens"], r["case"]
        assert all(n >= 4 for n in r["rebalances"]), r  # every rank re-planned with the driver
        assert sum(r["slots_moved"]) > 0, r  # experts really moved
        assert all(r["weights_ok"]), r  # each slot holds its expert's checkpoint weights
        start = [list(s) for s in replicate_hot_experts([1.0] * 16, nproc, nproc).slots]  # the engine's start
        if r["case"][2]:  # the file's per-layer placements were loaded, then re-planned
            layers = load_layer_placements(placement_file, 16, nproc)
            assert r["file_placements"] == [list(map(list, layers[i].slots)) for i in trace.moe_layers]
            start = None
        assert all(len(ranks) == nproc for ranks in r["placements"])
        assert any(layer != (start or r["file_placements"][i]) for i, layer in enumerate(r["placements"]))
