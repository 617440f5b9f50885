"""Decode steps whose MoE layers run eagerly, with each layer's attention part replayed as a CUDA graph
(moe_infer/engine/layer_graphs.py).

CPU: the pieces over the static buffers (capture=False) must give the plain eager result: the same
greedy tokens for a batch that is padded (3 sequences -> 4 rows), with an offloading store and with
a capacity policy, the same expert-load statistics (the MLPs see the step's rows only), and the decode
steps must take that path. GPU: the captured pieces against enforce_eager=True in float32, token for
token, for the cases that keep whole-step graphs off.
"""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import checkpoint
from moe_infer import LLM, SamplingParams
from moe_infer.engine.layer_graphs import LayerGraphs

PROMPTS = [[7, 19, 33, 41, 58, 62, 77, 80, 91, 15, 23], [11, 12, 13], list(range(40, 70))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

pytestmark = pytest.mark.timeout(300)


def _generate(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == [PARAMS.max_tokens] * len(PROMPTS), [o.outputs[0].error for o in outs]
    return tokens


@pytest.mark.parametrize("family,kw", [
    ("mixtral", dict(offload="cpu", slots_per_layer=2, miss_policy="auto")),
    ("qwen3_moe", dict(policy="drop", capacity_factor=1.0, min_capacity=1)),
], ids=["offload", "capacity"])
def test_static_buffer_pieces_equal_eager_cpu(family, kw):
    base = dict(model=checkpoint(family), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
                max_num_batched_tokens=64, **kw)
    eager = LLM(**base)
    want = _generate(eager)
    want_load = eager.engine.runner.stats.routed_LE.clone()
    llm = LLM(**base)
    runner = llm.engine.runner
    assert runner.layer_graphs is None  # CPU: never on by themselves
    runner.layer_graphs = LayerGraphs(runner.model, 4, -(-runner.max_model_len // 4), 4, runner.device, capture=False)
    assert _generate(llm) == want
    layers = len(runner.model.local_layers)
    assert runner.layer_graphs.runs >= (PARAMS.max_tokens - 1) * layers  # every decode step, every layer
    assert torch.equal(runner.stats.routed_LE, want_load)  # the padding row was not routed
    budget = LayerGraphs(runner.model, 4, 8, 4, runner.device, capture=False, max_buckets=2)
    assert [budget._may_capture(b) for b in [(1, 1), (2, 1), (1, 1), (4, 2), (2, 1)]] == [True, True, True, False, True]


def _cuda(family, **kw):
    return LLM(model=checkpoint(family), device="cuda", dtype="float32", block_size=4, num_kv_blocks=64,
               max_num_batched_tokens=64, **kw)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,kw", [
    ("mixtral", dict(offload="cpu", slots_per_layer=1, miss_policy="auto")),
    ("mixtral", dict(offload="cpu", slots_per_layer=1, miss_policy="cpu")),
    ("qwen3_moe", dict(policy="drop", capacity_factor=1.0, min_capacity=1)),
    ("qwen3_moe", dict(experts_backend="torch")),
], ids=["offload_auto", "offload_cpu", "capacity", "torch_experts"])
def test_layer_graphs_equal_eager_gpu(family, kw):
    want = _generate(_cuda(family, enforce_eager=True, **kw))
    llm = _cuda(family, **kw)
    runner = llm.engine.runner
    assert runner.graphs is None and runner.layer_graphs is not None
    assert _generate(llm) == want
    lg = runner.layer_graphs
    assert lg.disabled is None, lg.disabled
    assert lg.graphs and lg.runs >= (PARAMS.max_tokens - 1) * len(runner.model.local_layers)  # replayed
    llm.shutdown()
