"""Greedy generation through the engine with EP=2 and 4 (torchrun, gloo) equals the single-rank engine."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from engine_fixtures import checkpoint  # noqa: E402
from ep_engine_worker import CASES, PROMPTS, engine_kwargs, write_placement  # noqa: E402
from moe_infer import LLM, SamplingParams  # noqa: E402
from tests.dist.launch import torchrun  # noqa: E402

pytestmark = pytest.mark.distributed


def single_rank_tokens(path, policy):
    llm = LLM(model=path, **engine_kwargs("cpu", "float32"), policy=policy, capacity_factor=1.0, min_capacity=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    load = llm.get_expert_load()
    return [o.outputs[0].token_ids for o in outs], sum(sum(r["dropped"]) for r in load)


@pytest.mark.parametrize("nproc", [2, 4])
def test_ep_engine_greedy_equals_single_rank(nproc, tmp_path):
    path = checkpoint("qwen2_moe")  # 8 experts, a shared expert, a dense layer
    out = tmp_path / "tokens.json"
    placement = write_placement(path, nproc, str(tmp_path / "placement.json"))
    rc, log = torchrun(nproc, "ep_engine_worker.py", path, str(out), placement, timeout=300)
    assert rc == 0 and "EP ENGINE DONE" in log, log[-4000:]
    assert log.count("returned the driver's outputs") == nproc - 1, log[-4000:]
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == [list(c) for c in CASES]
    refs = {}
    for r in results:
        policy = r["case"][3]
        if policy not in refs:
            refs[policy] = single_rank_tokens(path, policy)
        tokens, dropped = refs[policy]
        assert r["tokens"] == tokens, f"case {r['case']}"
        assert r["dropped"] == dropped, f"case {r['case']}: dropped rows differ"
    assert refs["drop"][1] > 0  # the drop policy really dropped rows
