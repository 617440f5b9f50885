"""Prefill, chunked-prefill and mixed steps through ExtendGraphs' static buffers (moe_infer/engine/extend_graph.py).

CPU: the padded, static-buffer forward (capture=False) must give the unpadded eager result: the same
greedy tokens over steps whose token and sequence counts are not bucket sizes (so a padding sequence
and empty sequences are added), the same expert-load statistics (padding rows are not counted), and
the steps must actually take that path; once with the float32 reference attention, once with the paged
Triton kernel under the interpreter (the kernel the graphs capture). GPU: captured graphs against
enforce_eager=True in float32, token for token and the same load statistics, with the graph path taken.
"""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import checkpoint
from moe_infer import LLM, SamplingParams
from moe_infer.engine.extend_graph import ExtendGraphs, token_buckets

PROMPTS = [[7, 19, 33, 41, 58, 62, 77, 80, 91, 15, 23], [11, 12, 13], list(range(40, 70))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

pytestmark = pytest.mark.timeout(300)


def _sizes(T: int, B: int, max_query_len: int, width: int = 3):
    """A step's `step_inputs.Sizes`: (T, B, S, M, max_query_len, max_seq_len)."""
    return (T, B, B, width, max_query_len, max_query_len)


def test_token_buckets_and_step_buckets():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert token_buckets(600) == [16, 32, 64, 128, 256, 512, 600]
    assert token_buckets(10) == [10]
    with pytest.raises(ValueError, match="positive"):
        token_buckets(0)
    graphs = ExtendGraphs(lambda ids, pos: ids, 2048, 6, 8, 4, torch.device("cpu"), capture=False)
    assert graphs.max_seqs == 8  # 6 sequences and the padding one, as a power of two
    assert graphs.bucket(_sizes(1000, 1, 1000)) == (1024, 2, 1024)
    assert graphs.bucket(_sizes(100, 3, 40)) == (128, 4, 64)  # 28 padding rows; the longest query, 40, rounds to 64
    assert graphs.bucket(_sizes(1024, 1, 1024)) == (1024, 2, 1024)
    assert graphs.bucket(_sizes(16, 16, 1)) == (16, 32, 1)
    assert graphs.can_run(_sizes(100, 3, 40))
    assert not graphs.can_run(_sizes(3000, 1, 3000))  # more tokens than the largest bucket
    assert not graphs.can_run(_sizes(100, 8, 20))  # 8 sequences + the padding one > 8
    assert not graphs.can_run(_sizes(100, 3, 40, width=9))  # a block table wider than the buffers
    assert not graphs.can_run(_sizes(1025, 1, 1025))  # 511 padding rows do not fit one table row (32 keys)


def _generate(llm, prompts=PROMPTS, params=PARAMS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == [params.max_tokens] * len(prompts), [o.outputs[0].error for o in outs]
    return tokens


def _static_vs_eager(family: str, prompts=PROMPTS, params=PARAMS, **kw):
    path = checkpoint(family)
    kw = dict(model=path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=24,
              max_num_seqs=4, **kw)
    eager = LLM(**kw)
    want = _generate(eager, prompts, params)
    want_load = eager.engine.runner.stats.routed_LE.clone()
    assert eager.engine.scheduler.num_chunked_prefills > 0  # the 30-token prompt runs in chunks beside decodes

    llm = LLM(**kw)
    runner = llm.engine.runner
    assert runner.extend_graphs is None  # CPU: graphs are never on by themselves
    runner.extend_graphs = ExtendGraphs(runner.model, 24, 4, -(-runner.max_model_len // 4), 4, runner.device,
                                        capture=False, last_rows=runner.last_rows)
    got = _generate(llm, prompts, params)
    assert got == want
    # every step (prefill chunks, mixed, decode: no decode graphs here) went through the buffers, padded
    assert runner.extend_graphs.runs >= params.max_tokens
    assert torch.equal(runner.stats.routed_LE, want_load)  # padding rows are not counted


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_static_buffer_prefill_equals_eager_cpu(family):
    _static_vs_eager(family)


@pytest.mark.timeout(600)  # the interpreter runs every attention call
def test_static_buffer_prefill_triton_attention_interpreter():
    """The same through the paged Triton kernel (its grid from the bucket: padding and empty sequences)."""
    pytest.importorskip("moe_infer.layers.attention_triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU test below captures the real graphs")
    _static_vs_eager("qwen3_moe", PROMPTS[1:], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                     attention_backend="triton")


@pytest.mark.gpu
@pytest.mark.timeout(600)  # the first GPU test of a process JIT-compiles the Triton kernels
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_cuda_graph_prefill_equals_eager_gpu(family):
    kw = dict(model=checkpoint(family), device="cuda", dtype="float32", block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=24, max_num_seqs=4)
    eager = LLM(**kw, enforce_eager=True)
    assert eager.engine.runner.extend_graphs is None
    want = _generate(eager)
    llm = LLM(**kw)
    graphs = llm.engine.runner.extend_graphs
    assert graphs is not None and graphs.capture
    got = _generate(llm)
    assert graphs.disabled is None, graphs.disabled
    assert graphs.runs > 0 and graphs.graphs  # replayed, not eager
    # each bucket as two graphs: the first layer, then the rest (the capture replays the first one before the
    # padding mask is back: the load statistics below count no row twice)
    assert len(llm.engine.runner.model.local_layers) > 1 and all(len(g) == 2 for g, _ in graphs.graphs.values())
    assert got == want
    assert torch.equal(llm.engine.runner.stats.routed_LE, eager.engine.runner.stats.routed_LE)
    assert _generate(llm) == want  # the second time: every bucket replays a graph captured before


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_prefill_graphs_off_where_unsafe_gpu():
    kw = dict(model=checkpoint("qwen3_moe"), device="cuda", dtype="float32", block_size=4, num_kv_blocks=64)
    eager_reserve = LLM(**kw, enforce_eager=True).engine.runner._activation_bytes()
    for off in (dict(attention_backend="sdpa"),  # sized from the data
                dict(cuda_graph_max_tokens=0), dict(policy="drop")):  # drop: a capacity would count padding
        runner = LLM(**kw, **off).engine.runner
        assert runner.extend_graphs is None, off
        # no graph pool for those steps, so the KV budget keeps no room for one
        assert runner._activation_bytes() == eager_reserve, off
    assert LLM(**kw).engine.runner._activation_bytes() > eager_reserve  # graphs on: their pool is kept out


@pytest.mark.parametrize("lengths", [[700], [1, 1, 300, 1, 33, 5], [3, 1, 1]])
def test_load_lays_out_the_padded_step(lengths):
    """`ExtendGraphs.load` against the padding rule written out per row and sequence (a naive loop over the
    plan, test_step_inputs' `_naive`): the graph's views of the bucket, the step's unpadded inputs, and the
    device pointers the graph reads, 16-byte aligned and the same for every step of the bucket."""
    import random

    from test_step_inputs import _naive, _plan

    from moe_infer.engine.step_inputs import flat_inputs

    bs, width = 16, 64
    graphs = ExtendGraphs(lambda ids, pos: ids, 1024, 8, width, bs, torch.device("cpu"), capture=False)
    # first a longer step with more sequences into both staging buffers: what it leaves there must not show
    dirty = _plan([900, 9, 1, 7, 2, 1, 1], bs, random.Random(99))
    for _ in range(2):
        graphs.load(*flat_inputs(dirty, bs, extra=list(range(1, 15))), 14)
    plan = _plan(lengths, bs, random.Random(len(lengths)))
    flat, sizes = flat_inputs(plan, bs, extra=[5, 6, 7, 8])
    inputs, extra_X = graphs.load(flat, sizes, 4)
    ids, pos, slots, qsl, lens, rows, tables = _naive(plan, bs)
    T, B, m = len(ids), len(plan.seqs), len(tables[0])
    Tp, Bp, _ = inputs.bucket
    pad = Tp - T
    v = graphs._views(Tp, Bp)
    assert v["ids"].tolist() == ids + [0] * pad
    assert v["positions"].tolist() == pos + list(range(pad))
    assert v["slots"].tolist() == slots + [-1] * pad
    assert v["valid"].tolist() == [True] * T + [False] * pad
    assert v["query_starts"].tolist() == qsl + [Tp] * (Bp - B)  # sequence B: the padding rows; later ones empty
    assert v["seq_lens"].tolist() == lens + [max(pad, 1)] * (Bp - B)
    assert v["block_tables"].tolist() == [t + [-1] * (width - m) for t in tables] + [[0] * width] * (Bp - B)
    assert extra_X.tolist() == [5, 6, 7, 8] and inputs.sample_rows_S.tolist() == rows
    meta = inputs.meta  # the step itself, unpadded (an eager run, the sampler)
    assert inputs.input_ids_T.tolist() == ids and meta.positions_T.tolist() == pos
    assert meta.slot_mapping_T.tolist() == slots and meta.block_tables_BM.tolist() == tables
    assert meta.query_start_loc_B1.tolist() == qsl and meta.seq_lens_B.tolist() == lens
    assert all(t.data_ptr() % 16 == 0 for t in v.values())
    again, _ = graphs.load(*flat_inputs(plan, bs), 0)
    assert again.bucket == inputs.bucket and graphs._views(Tp, Bp)["ids"].data_ptr() == v["ids"].data_ptr()
