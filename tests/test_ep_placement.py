"""Expert placements (contiguous, file, hot-expert replicas), single-rank init (ParallelDims: test_mesh_units.py)."""
import json

import pytest

from moe_infer.config import ParallelConfig
from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.parallel import ExpertPlacement, contiguous_placement, init, load_placement, replicate_hot_experts


def test_contiguous_placement_matches_loader_contract():
    p = contiguous_placement(8, 4)
    assert p.local_experts(2) == [4, 5] and p.num_redundant == 0
    with pytest.raises(ValueError, match="not divisible by parallel.ep=3"):
        contiguous_placement(8, 3)


def test_placement_rejects_bad_layouts():
    with pytest.raises(ValueError, match="same positive number"):
        ExpertPlacement(4, 2, ((0, 1), (2, 3, 0)))
    with pytest.raises(ValueError, match="no slot"):
        ExpertPlacement(4, 2, ((0, 1), (2, 1)))
    with pytest.raises(ValueError, match="twice"):
        ExpertPlacement(4, 2, ((0, 0, 1), (2, 3, 1)))
    with pytest.raises(ValueError, match="outside"):
        ExpertPlacement(4, 2, ((0, 1), (2, 4)))


def test_placement_file_roundtrip_and_mismatch(tmp_path):
    p = ExpertPlacement(4, 2, ((0, 1, 3), (2, 3, 0)))
    path = tmp_path / "placement.json"
    path.write_text(p.to_json())
    assert load_placement(str(path), 4, 2) == p
    with pytest.raises(ValueError, match="parallel.ep=4"):
        load_placement(str(path), 4, 4)
    path.write_text(json.dumps({"ep": 2, "ranks": []}))
    with pytest.raises(ValueError, match="missing key 'num_experts'"):
        load_placement(str(path), 4, 2)
    replicas_EM, num_rep_E = p.replica_table()
    assert num_rep_E.tolist() == [2, 1, 1, 2]
    assert replicas_EM[3].tolist() == [2, 4] and replicas_EM[0].tolist() == [0, 5]


def test_hot_experts_get_replicas_on_other_ranks():
    load = [1.0] * 8
    load[5], load[1] = 20.0, 10.0
    p = replicate_hot_experts(load, ep=2, num_redundant=2)
    assert p.slots_per_rank == 5
    assert p.local_experts(0)[-1] == 5 and p.local_experts(1)[-1] == 1  # each hot expert on the other rank
    with pytest.raises(ValueError, match="multiple of ep"):
        replicate_hot_experts(load, ep=2, num_redundant=3)


def test_single_rank_init_needs_no_process_group():
    ctx = init(ParallelConfig(), device="cpu")
    assert not ctx.is_distributed and ctx.is_driver and ctx.broadcast_object({"a": 1}) == {"a": 1}
    from moe_infer.config import RoutingConfig

    assert type(ctx.make_dispatcher(8, 2, RoutingConfig())) is LocalDispatcher


def test_ep_without_torchrun_says_how_to_start(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        init(ParallelConfig(ep=2), device="cpu")


def test_parallel_config_names_bad_fields():
    with pytest.raises(ValueError, match="parallel.dispatcher"):
        ParallelConfig(dispatcher="nccl")
    with pytest.raises(ValueError, match="parallel.timeout_s"):
        ParallelConfig(timeout_s=0)
    with pytest.raises(ValueError, match="parallel.overlap_min_mb"):
        ParallelConfig(overlap_min_mb=-1)
    with pytest.raises(ValueError, match="parallel.overlap_micro_batches"):
        ParallelConfig(overlap_micro_batches=1)
