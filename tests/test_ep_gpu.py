"""On CUDA GPUs with NCCL: the EP layer and engine equality tests, in bf16 (and fp32 for the layer).

Needs as many GPUs as ranks (nvidia-h200-x2 for 2 ranks, -x4 for 4); skipped elsewhere.
"""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from engine_fixtures import checkpoint  # noqa: E402
from ep_engine_worker import CASES, PROMPTS, engine_kwargs, write_placement  # noqa: E402
from moe_infer import LLM, SamplingParams  # noqa: E402
from tests.dist.launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def _need(n):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices, found {torch.cuda.device_count()}")


@pytest.mark.parametrize("nproc", [2, 4])
def test_ep_layer_equals_single_rank_nccl(nproc):
    _need(nproc)
    rc, out = torchrun(nproc, "ep_layer_worker.py", "--device", "cuda", "--dtypes", "bfloat16,float32",
                       "--experts", "torch,triton", timeout=400)
    print(out[-1500:])
    assert rc == 0 and "EP LAYER OK 160" in out, out[-4000:]


@pytest.mark.parametrize("nproc", [2, 4])
def test_ep_engine_greedy_equals_single_rank_nccl_bf16(nproc, tmp_path):
    _need(nproc)
    path = checkpoint("qwen2_moe")
    kwargs = engine_kwargs("cuda", "bfloat16")
    refs = {}
    for policy in sorted({c[3] for c in CASES}):
        llm = LLM(model=path, **kwargs, policy=policy, capacity_factor=1.0, min_capacity=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        refs[policy] = [o.outputs[0].token_ids for o in outs]
        del llm
    torch.cuda.empty_cache()
    out = tmp_path / "tokens.json"
    placement = write_placement(path, nproc, str(tmp_path / "placement.json"))
    rc, log = torchrun(nproc, "ep_engine_worker.py", path, str(out), placement, "--device", "cuda",
                       "--dtype", "bfloat16", timeout=400)
    assert rc == 0 and "EP ENGINE DONE" in log, log[-4000:]
    for r in json.loads(out.read_text())["results"]:
        assert r["tokens"] == refs[r["case"][3]], f"case {r['case']}"
