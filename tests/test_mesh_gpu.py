"""The mesh on GPUs: every layout's steps replayed as CUDA graphs with their collectives captured inside, and greedy
tokens equal to the one-GPU engine's (float32, tiny Qwen3-MoE). One GPU: the mesh's code path at degree 1
(parallel.force_mesh: process groups of one rank, whose collectives still run and are captured). Two GPUs: tp=2,
ep=2, pp=2 and tp=2 with ep=2 under torchrun (NCCL); ep=2 with attention data parallelism (two replicas of one GPU,
each with requests of its own)."""
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from engine_fixtures import checkpoint  # noqa: E402
from mesh_gpu_worker import PROMPTS  # noqa: E402
from moe_infer import LLM, SamplingParams  # noqa: E402
from tests.dist.launch import ROOT, torchrun, worker_env  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def _one_gpu_tokens(path):
    llm = LLM(model=path, dtype="float32", device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert llm.engine.runner.graphs is not None
    return [o.outputs[0].token_ids for o in outs]


def _check(results, want, layouts):
    assert [r["layout"] for r in results] == layouts
    for r in results:
        name = "tp={} pp={} ep={}".format(*r["layout"])
        assert r["tokens"] == want, name
        assert all(n > 0 for n in r["decode_runs"]) and all(n > 0 for n in r["prefill_runs"]), (name, r)
        # every rank captured its collectives: at least one a layer of its stage (none where its stage is one rank:
        # pipeline stages send between the graphs; at degree 1 the groups of one rank keep theirs)
        tp, pp, ep = r["layout"][:3]
        least = r["num_layers"] // pp if tp > 1 or ep > 1 or pp * tp * ep == 1 else 0
        assert all(n >= least for n in r["captured"]), (name, r)
        assert r["lookahead"] == (r["layout"][1] == 1), name  # the driver schedules ahead without pipeline stages
        if len(r["layout"]) > 3 and r["layout"][3]:  # attention data parallelism: both replicas ran requests
            assert min(r["replica_tokens"]) > 0, (name, r["replica_tokens"])


def test_mesh_at_degree_one_replays_graphs_with_collectives(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = checkpoint("qwen3_moe")
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"checkpoint": path, "layouts": [[1, 1, 1]]}))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "dist", "mesh_gpu_worker.py"), str(spec),
                           str(out)], cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0 and "MESH GPU DONE 1" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check(json.loads(out.read_text()), _one_gpu_tokens(path), [[1, 1, 1]])


def test_mesh_layouts_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = checkpoint("qwen3_moe", num_hidden_layers=4)
    layouts = [[2, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 2]]
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"checkpoint": path, "layouts": layouts}))
    rc, log = torchrun(2, "mesh_gpu_worker.py", str(spec), str(out), timeout=800)
    assert rc == 0 and f"MESH GPU DONE {len(layouts)}" in log, log[-4000:]
    _check(json.loads(out.read_text()), _one_gpu_tokens(path), layouts)


def test_dp_attention_on_two_gpus(tmp_path):
    """ep=2 with parallel.dp_attention: each GPU's attention runs its own requests, the MoE layers gather both GPUs'
    rows and reduce-scatter them back, every step a CUDA graph with those collectives inside; tokens equal one GPU's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = checkpoint("qwen3_moe", num_hidden_layers=4)
    layouts = [[1, 1, 2, 1]]
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"checkpoint": path, "layouts": layouts}))
    rc, log = torchrun(2, "mesh_gpu_worker.py", str(spec), str(out), timeout=800)
    assert rc == 0 and f"MESH GPU DONE {len(layouts)}" in log, log[-4000:]
    _check(json.loads(out.read_text()), _one_gpu_tokens(path), layouts)
