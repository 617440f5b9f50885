"""`offload.expert_graphs`: an offloaded layer step's device experts through static buffers replayed as CUDA
graphs (moe_infer/offload/expert_graphs.py). On CPU the same static-buffer path runs eagerly (capture=False):
padding rows with id -1, the hand-over of rows, ids and weights, one entry per weight tensors and padded size."""
from __future__ import annotations

import pytest
import torch

from moe_infer import LLM, SamplingParams
from moe_infer.offload.expert_graphs import ExpertGraphs
from test_moe_layer import _naive_moe as _naive_experts  # a loop over rows and ids (-1: none), the reference
from test_offload_engine import TINY_PROMPTS, tiny_resident_tokens  # noqa: F401  (a module fixture)


@pytest.mark.timeout(60)
def test_static_buffers_give_the_direct_result():
    """Rows 3 (padded to 4), 4, 3 again (the same entry: its fourth row, left from the call of 4, must run no
    expert), 5 (padded to 8) over two weight sets; more rows than max_rows run as they are."""
    torch.manual_seed(0)
    S, D, F, K = 3, 8, 6, 2
    weights = [(torch.randn(S, 2 * F, D), torch.randn(S, D, F)) for _ in range(2)]
    graphs = ExpertGraphs("cpu", capture=False, max_rows=8)
    calls = [(3, 0), (4, 0), (3, 0), (5, 1), (9, 1)]
    for T, w in calls:
        x_TD = torch.randn(T, D)
        ids_TK = torch.randint(-1, S, (T, K))
        weights_TK = torch.rand(T, K)
        got = graphs(_naive_experts, x_TD, ids_TK, weights_TK, *weights[w])
        torch.testing.assert_close(got, _naive_experts(x_TD, ids_TK, weights_TK, *weights[w]))
        entry = graphs.entries.get((weights[w][0].data_ptr(), weights[w][1].data_ptr(), ExpertGraphs.padded(T), K,
                                    x_TD.dtype, ids_TK.dtype, weights_TK.dtype))
        if entry is not None:  # pad rows run no expert (a stale row of a larger call would cost a real one)
            assert entry.ids_TK.shape[0] == ExpertGraphs.padded(T) and bool((entry.ids_TK[T:] == -1).all())
    assert graphs.replays == 4 and graphs.eager == 1
    assert sorted(key[2] for key in graphs.entries) == [4, 8]  # (w 0, 4 rows) twice and once; (w 1, 8 rows)


@pytest.mark.timeout(300)
def test_tiny_model_with_expert_graphs_equals_resident(tiny_resident_tokens):  # noqa: F811
    """The engine's slot compute and its streamed chunks go through the static buffers: the resident engine's
    greedy tokens, with entries for the layers' slots and the shared stream buffers."""
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64, offload="cpu", slots_per_layer=2,
              stream_fraction=0.25, miss_policy="wait")
    m = llm.engine.runner.offload
    assert m.expert_graphs is None  # never on a CPU device (on by default on CUDA)
    m.expert_graphs = ExpertGraphs(m.device, capture=False)
    outs = llm.generate(TINY_PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tiny_resident_tokens
    total = llm.get_offload_stats()["total"]
    assert total["streamed"] > 0 and m.expert_graphs.replays > 0
    buffers = {b.w13_C2FD.data_ptr() for b in m.buffers}
    used = {key[0] for key in m.expert_graphs.entries}
    assert used & buffers and used - buffers  # the stream buffers' entries and the cache slots'


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_expert_graphs_on_cuda_equal_resident():
    """offload.expert_graphs on CUDA: captured graphs replay the slot compute and the streamed chunks; the
    resident engine's greedy tokens (fp32, chunked prefill: the prefill calls run eagerly, decode replays)."""
    from engine_fixtures import checkpoint
    from test_engine_parity import PROMPTS

    kw = dict(model=checkpoint("mixtral"), dtype="float32", device="cuda", block_size=4, num_kv_blocks=16,
              max_num_batched_tokens=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**kw, offload="cpu", slots_per_layer=3, stream_fraction=0.25, miss_policy="wait", expert_graphs=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    graphs = llm.engine.runner.offload.expert_graphs
    assert graphs.disabled is None and graphs.replays > 0 and any(e.graph is not None for e in graphs.entries.values())
    assert llm.get_offload_stats()["total"]["streamed"] > 0
    llm.shutdown()
    eager = LLM(**kw, offload="cpu", slots_per_layer=3, expert_graphs=True, enforce_eager=True)
    assert eager.engine.runner.offload.expert_graphs is None  # model.enforce_eager: no CUDA graph of any kind
    eager.shutdown()
