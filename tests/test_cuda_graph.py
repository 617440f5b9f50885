"""Decode steps through DecodeGraphs' static buffers (moe_infer/engine/cuda_graph.py).

CPU: the padded, static-buffer forward (capture=False) must give the unpadded eager result: the
same greedy tokens for a batch whose size is not a capture size (so rows are padded), the same
expert-load statistics (padding rows are not counted), and the decode steps must actually take
that path. GPU: the captured graphs against enforce_eager=True, in float32 (token for token) and
the graph path taken; plus the cases that must stay eager.
"""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import checkpoint
from moe_infer import LLM, SamplingParams
from moe_infer.engine.cuda_graph import DecodeGraphs, capture_sizes, context_blocks, replay_graph
from moe_infer.parallel.health import MeshError

PROMPTS = [[7, 19, 33, 41, 58, 62, 77, 80, 91, 15, 23], [11, 12, 13], list(range(40, 70))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

pytestmark = pytest.mark.timeout(180)  # an engine loop that stops making progress must fail, not spin


def test_capture_sizes_and_context_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(24) == [1, 2, 4, 8, 16, 24]
    with pytest.raises(ValueError, match="positive"):
        capture_sizes(0)
    assert [context_blocks(n, 64) for n in (1, 2, 3, 5, 17, 64)] == [1, 2, 4, 8, 32, 64]
    assert context_blocks(40, 48) == 48  # capped at the block table's width


def _generate(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == [PARAMS.max_tokens] * len(PROMPTS), [o.outputs[0].error for o in outs]
    return tokens


def test_failed_capture_under_a_mesh_stops_the_engine():
    """Under a mesh a rank whose capture fails must not fall back to eager steps (its collectives would leave the
    others' graphs waiting): the failure is the mesh's error, and nothing is marked as captured."""
    class Owner:
        graphs, runs, disabled, mesh = {}, 0, None, True

    def capture():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(MeshError, match="capture failed under a mesh for a decode step.*not permitted"):
        replay_graph(Owner, (8, 1, True), capture, "a decode step")
    assert Owner.graphs == {} and Owner.disabled is None


@pytest.mark.parametrize("family,lm_head", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_static_buffer_decode_equals_eager_cpu(family, lm_head):
    """The engine's decode path through the static buffers (one host copy, `load`; the LM head into the logits
    buffer with lm_head), run eagerly on CPU: the same tokens and load statistics as the plain eager engine."""
    path = checkpoint(family)
    kw = dict(model=path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
    eager = LLM(**kw)
    want = _generate(eager)
    want_load = eager.engine.runner.stats.routed_LE.clone()

    llm = LLM(**kw)
    runner = llm.engine.runner
    assert runner.graphs is None  # CPU: graphs are never on by themselves
    runner.graphs = DecodeGraphs(runner.model, 8, -(-runner.max_model_len // 4), 4, runner.device, capture=False,
                                 lm_head=runner.model.lm_head if lm_head else None)
    kv_before = [t.clone() for kv in runner.kv_caches for t in kv]
    with torch.inference_mode():
        runner.graphs.warmup()  # all rows padding: writes no KV slot, counts no load
    assert all(torch.equal(a, b) for a, b in zip(kv_before, (t for kv in runner.kv_caches for t in kv)))
    assert runner.stats.routed_LE.sum() == 0
    got = _generate(llm)
    assert got == want
    assert runner.graphs.runs >= PARAMS.max_tokens - 1  # every decode step went through the buffers
    # 3 sequences padded to 4 rows: the padding row must not show up in the load statistics
    assert torch.equal(runner.stats.routed_LE, want_load)


def _cuda_llm(**kw):
    return LLM(model=checkpoint("qwen3_moe"), device="cuda", block_size=4, num_kv_blocks=64,
               max_num_batched_tokens=64, **kw)


@pytest.mark.gpu
@pytest.mark.timeout(600)  # the first GPU test of a process JIT-compiles the Triton kernels
def test_cuda_graph_decode_equals_eager_gpu():
    eager = _cuda_llm(dtype="float32", enforce_eager=True)
    assert eager.engine.runner.graphs is None
    want = _generate(eager)
    llm = _cuda_llm(dtype="float32")
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.capture
    got = _generate(llm)
    assert graphs.disabled is None, graphs.disabled
    assert graphs.runs >= PARAMS.max_tokens - 1 and graphs.graphs  # replayed, not eager
    assert got == want
    assert torch.equal(llm.engine.runner.stats.routed_LE, eager.engine.runner.stats.routed_LE)
    # a second batch of another size reuses or adds graphs and still matches
    assert _generate(llm) == want


@pytest.mark.gpu
@pytest.mark.timeout(600)  # the first GPU test of a process JIT-compiles the Triton kernels
@pytest.mark.parametrize("kw", [dict(experts_backend="torch"), dict(policy="drop")])
def test_cuda_graph_off_where_unsafe_gpu(kw):
    llm = _cuda_llm(dtype="float32", **kw)
    assert llm.engine.runner.graphs is None
    assert len(_generate(llm)[0]) == PARAMS.max_tokens
