"""Attention data parallelism (parallel.dp_attention) on a TP x PP x EP mesh (torchrun, gloo): greedy tokens equal the
single-rank engine's, and the replicas really run requests of their own.

Layouts (tp, pp, ep): (1,1,2) two replicas of one rank, (2,1,4) two replicas of two tensor-parallel ranks, (1,2,2)
two stages of two replicas. Workloads (tests/dist/mesh_worker.py): the mesh tests' four prompts (a tiny KV cache
that preempts, prompts chunked), and "dp": ten requests for replicas of three sequences each, with shared prefixes
(prefix caching on) and 1-14 tokens each (requests end at different steps, a replica idles in some). Checks per case:
the tokens and finish reasons; each rank counted the real rows of its replica's requests in its first layer, as many
as the driver scheduled on that replica, both replicas some (the padding rows left out); with one stage, every MoE
layer but the last counted K rows per scheduled token (no padding row in the expert-load statistics).
"""
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from mesh_worker import engine_kwargs, generate, world_of  # noqa: E402
from moe_infer import LLM  # noqa: E402
from tests.dist.launch import torchrun  # noqa: E402
from tiny_hf import make_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TINY_MOE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "moe_infer", "assets", "tiny_moe")
_REFS = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp_ckpt")
    return {"qwen3_moe": make_tiny_checkpoint("qwen3_moe", root / "qwen3_moe", seed=1234, num_hidden_layers=2),
            "mixtral": make_tiny_checkpoint("mixtral", root / "mixtral", seed=7, num_hidden_layers=2,
                                            num_local_experts=8),
            "tiny_moe": TINY_MOE}


def single_rank(path, workload):
    key = (path, workload)
    if key not in _REFS:
        llm = LLM(model=path, **engine_kwargs(workload))
        outs = generate(llm, workload)
        _REFS[key] = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs],
                      llm.engine.runner.arch.top_k)
    return _REFS[key]


def cases_of(world, ckpts):
    cases = {
        2: [dict(family="qwen3_moe", tp=1, pp=1, ep=2, num_kv_blocks=13),  # a replica's two requests need 17
            dict(family="qwen3_moe", tp=1, pp=1, ep=2, workload="dp"),
            dict(family="tiny_moe", tp=1, pp=1, ep=2, workload="dp"),
            dict(family="mixtral", tp=1, pp=1, ep=2, workload="dp", static_buffers=True)],
        4: [dict(family="qwen3_moe", tp=2, pp=1, ep=4, workload="dp"),
            dict(family="mixtral", tp=2, pp=1, ep=4, static_buffers=True, num_kv_blocks=13),
            dict(family="qwen3_moe", tp=1, pp=2, ep=2, workload="dp")],
    }[world]
    return [dict(c, checkpoint=ckpts[c["family"]], dp_attention=True) for c in cases]


def run_cases(world, cases, tmp_path):
    spec, out = tmp_path / "spec.json", tmp_path / "tokens.json"
    spec.write_text(json.dumps({"cases": cases}))
    rc, log = torchrun(world, "mesh_worker.py", str(spec), str(out), timeout=840)
    assert rc == 0 and f"MESH DONE {len(cases)}" in log, log[-4000:]
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == cases
    # per case, each rank's real rows: "rank k replica r real rows N", in case order per rank
    rows = {}
    for rank, replica, n in re.findall(r"rank (\d+) replica (\d+) real rows (\d+)", log):
        rows.setdefault(int(rank), []).append((int(replica), int(n)))
    assert sorted(rows) == list(range(world)) and all(len(v) == len(cases) for v in rows.values()), log[-4000:]
    return results, rows


@pytest.mark.parametrize("world", [2, 4])
def test_dp_attention_greedy_equals_single_rank(world, checkpoints, tmp_path):
    cases = cases_of(world, checkpoints)
    assert all(world_of(c) == world for c in cases)
    results, rows = run_cases(world, cases, tmp_path)
    for i, r in enumerate(results):
        c = r["case"]
        workload = c.get("workload", "default")
        name = (f"{c['family']} tp={c['tp']} pp={c['pp']} ep={c['ep']} {workload}"
                f"{' static' if c.get('static_buffers') else ''}")
        tokens, finish, top_k = single_rank(c["checkpoint"], workload)
        assert r["tokens"] == tokens, name
        assert r["finish"] == finish, name
        per_replica = r["replica_tokens"]
        assert len(per_replica) == 2 and min(per_replica) > 0, (name, per_replica)  # both replicas ran requests
        for rank, got in rows.items():  # every rank ran exactly its replica's scheduled rows
            replica, n = got[i]
            assert n == per_replica[replica], (name, rank, got[i], per_replica)
        if c["pp"] == 1:  # no padding row counted: K rows a scheduled token (the last layer: pruned prompt steps)
            assert [sum(row["routed"]) for row in r["load"][:-1]] == [top_k * sum(per_replica)] * (len(r["load"]) - 1)
        if workload == "default":  # the tiny cache preempts on each replica
            assert min(r["replica_preemptions"]) > 0 and r["chunked"] > 0, (name, r["replica_preemptions"])
        else:  # the shared prefixes were found in a replica's prefix cache
            assert r["prefix_hits"] > 0, name


def test_dp_attention_needs_replicas():
    from moe_infer.parallel.dims import ParallelDims

    with pytest.raises(ValueError, match=r"dp_attention=true needs attention replicas .* parallel.tp=2, "
                                         r"parallel.ep=2 give dp=1"):
        ParallelDims(2, tp=2, ep=2, dp_attention=True)
    with pytest.raises(ValueError, match="parallel.tp=1, parallel.ep=1 give dp=1"):
        LLM(model=TINY_MOE, device="cpu", dtype="float32", dp_attention=True)
    assert ParallelDims(4, tp=2, ep=4, dp_attention=True).num_replicas == 2
