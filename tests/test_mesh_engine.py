"""Greedy tokens on a TP x PP x EP mesh (torchrun, gloo) equal the single-rank engine's.

Layouts (tp, pp, ep): (2,1,1) is tensor-parallel MoE (each expert's F split), (1,2,1) pipeline stages,
(2,1,2) experts over the tensor-parallel ranks, (1,2,2) stages of two attention replicas with experts
over them, (2,2,2) all three, (4,1,4) more ranks than KV heads (replicated KV heads). Families: Mixtral
and Qwen3-MoE in every layout; Qwen2-MoE (3 layers: an uneven pipeline split, a dense layer, a gated
shared expert), OLMoE (whole-projection q/k norm over the ranks, a vocabulary padded to 4 ranks),
DeepSeek-V3 (MLA heads split over tp, the latent cache replicated; a dense first layer) and GPT-OSS (sinks split
with the heads, expert biases, alternating windows) in some. Every case runs with a cache small enough to preempt
and a token budget that chunks every prompt. One torchrun launch per world size; about 2.5 CPU-minutes in all.
"""
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from mesh_worker import ENGINE, generate, world_of  # noqa: E402
from moe_infer import LLM  # noqa: E402
from tests.dist.launch import torchrun  # noqa: E402
from tiny_hf import make_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CHECKPOINTS = {  # family -> checkpoint overrides (2-3 layers, hidden 64)
    "mixtral": dict(num_hidden_layers=2, num_local_experts=8),
    "qwen3_moe": dict(num_hidden_layers=2),
    "qwen2_moe": dict(num_hidden_layers=3),
    "olmoe": dict(num_hidden_layers=2, vocab_size=162),
    "deepseek_v3": dict(num_hidden_layers=3),  # MLA heads split, latent cache replicated; a dense first layer
    "gpt_oss": dict(num_hidden_layers=2),  # sinks split with the heads; expert biases (down bias once under moe_tp)
}
LAYOUTS = {  # (tp, pp, ep) -> families
    (2, 1, 1): ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"],
    (1, 2, 1): ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"],
    (2, 1, 2): ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"],
    (1, 2, 2): ["mixtral", "qwen3_moe"],
    (2, 2, 2): ["mixtral", "qwen3_moe"],
    (4, 1, 4): ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"],
}
# the same layouts with every step through the CUDA-graph paths' static buffers (run eagerly: no GPU here)
STATIC_BUFFERS = {(2, 1, 1): ["qwen3_moe"], (1, 2, 1): ["qwen2_moe"], (2, 1, 2): ["mixtral"], (2, 2, 2): ["qwen3_moe"]}
_REFS = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh_ckpt")
    return {f: make_tiny_checkpoint(f, root / f, seed=1234, **kw) for f, kw in CHECKPOINTS.items()}


def single_rank(path):
    """(tokens, preemptions, rows each MoE layer counted) of the single-rank engine."""
    if path not in _REFS:
        llm = LLM(model=path, **ENGINE)
        outs = generate(llm)
        _REFS[path] = ([o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions,
                       [sum(row["routed"]) for row in llm.get_expert_load()])
    return _REFS[path]


@pytest.mark.parametrize("world", [2, 4])
def test_mesh_greedy_equals_single_rank(world, checkpoints, tmp_path):
    cases = [dict(family=f, checkpoint=checkpoints[f], tp=tp, pp=pp, ep=ep)
             for (tp, pp, ep), fams in LAYOUTS.items() for f in fams]
    cases += [dict(family=f, checkpoint=checkpoints[f], tp=tp, pp=pp, ep=ep, static_buffers=True)
              for (tp, pp, ep), fams in STATIC_BUFFERS.items() for f in fams]
    cases = [c for c in cases if world_of(c) == world]
    spec, out = tmp_path / "spec.json", tmp_path / "tokens.json"
    spec.write_text(json.dumps({"cases": cases}))
    rc, log = torchrun(world, "mesh_worker.py", str(spec), str(out), timeout=540)
    assert rc == 0 and f"MESH DONE {len(cases)}" in log, log[-4000:]
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == cases
    # every rank ran the decode and the prefill steps of those cases through the buffers (ranks' lines may interleave)
    static = re.findall(r"static buffers: \d+ outputs, buffer runs (\d+) decode (\d+) prefill", log)
    assert len(static) == world * sum(1 for c in cases if c.get("static_buffers")), log[-4000:]
    assert all(int(d) > 0 and int(p) > 0 for d, p in static), static
    for r in results:
        c = r["case"]
        name = f"{c['family']} tp={c['tp']} pp={c['pp']} ep={c['ep']}{' static' if c.get('static_buffers') else ''}"
        tokens, preemptions, rows = single_rank(c["checkpoint"])
        assert preemptions > 0  # the reference itself preempts
        assert r["tokens"] == tokens, name
        assert r["finish"] == ["length"] * len(tokens), name
        assert r["chunked"] > 0 and r["preemptions"] > 0, name
        if c["pp"] == 1:  # the same schedule as one rank
            assert r["preemptions"] == preemptions, name
            # the same rows through every MoE layer; the last one runs a prompt step's last rows only
            # (model.prune_last_layer, on the mesh's last stage as on one rank)
            assert [sum(row["routed"]) for row in r["load"]] == rows, name
        # the driver reports every layer's expert load, the other stages' included
        assert all(sum(row["routed"]) > 0 for row in r["load"]), name
        assert sum(r["load"][-1]["routed"]) < sum(r["load"][0]["routed"]), name  # the last layer pruned


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(spec_paths, out_path, timeout=300):
    """Two torchrun launches (--nnodes 2, one process each) meeting through c10d rendezvous on localhost."""
    import subprocess

    from tests.dist.launch import ROOT

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"mesh{port}",
         os.path.join(ROOT, "tests", "dist", "mesh_worker.py"), str(spec), str(out_path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for spec in spec_paths]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], "\n".join(logs)


def test_two_nodes_through_c10d_rendezvous(checkpoints, tmp_path):
    """Two "machines" (one torchrun each, --nnodes 2) run two pipeline stages; a node started with another
    config fails at start on both, naming the field."""
    case = dict(family="qwen3_moe", checkpoint=checkpoints["qwen3_moe"], tp=1, pp=2, ep=1)
    spec, out = tmp_path / "spec.json", tmp_path / "tokens.json"
    spec.write_text(json.dumps({"cases": [case]}))
    rcs, log = two_nodes([spec, spec], out)
    assert rcs == [0, 0] and "MESH DONE 1" in log, log[-4000:]
    assert json.loads(out.read_text())["results"][0]["tokens"] == single_rank(case["checkpoint"])[0]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"cases": [dict(case, max_num_seqs=7)]}))
    rcs, log = two_nodes([spec, other], tmp_path / "none.json")
    assert rcs[0] != 0 and rcs[1] != 0, log[-4000:]
    assert "ranks were started with different configs: scheduler.max_num_seqs" in log, log[-4000:]
