"""The last layer of a prompt step runs each sequence's last row only (moe_infer/layers/last_rows.py).

Model level (CPU, float32, every family): one step of three sequences (a 9-row prompt, a 6-row prompt, one
decode row over a cached context), forwarded once over every row and once with `last_rows`: the pruned output
must be the full output at each sequence's last row, and the KV cache of every layer must hold the same bytes
(the last layer still writes the K/V of every row: a later step reads them). The reference is the same model
without the option: every row through every layer, as transformers runs it (tests/test_engine_parity.py
checks the engine, option on, against transformers itself).

Engine level: greedy tokens with the option on and off are equal over chunked prefill, mixed steps and
prefix caching, eager and through ExtendGraphs' static buffers (capture=False); the last layer's load
statistics count one row a sequence, never a padding row; the option is off where rows are coupled (a
capacity policy) or every row is recorded (the routing trace). GPU: the captured prefill graphs with it on and
off give the same tokens.
"""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import checkpoint
from moe_infer import LLM, SamplingParams
from moe_infer.engine.extend_graph import ExtendGraphs
from moe_infer.layers.forward_context import AttentionMetadata, forward_context

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(3, 40)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 11, 12, 13, 14]]


def _step(block_size: int, device: torch.device):
    """Three sequences: 9 new rows from position 0, 6 new rows from 0, and 1 row at position 7 (7 cached keys:
    written by the `_context` step first). Tokens [16], metadata, each sequence's last row."""
    lens, starts = [9, 6, 1], [0, 0, 7]
    tables = [[0, 1, 2], [3, 4, -1], [5, 6, -1]]
    ids, pos, slot, qs = [], [], [], [0]
    for b, (n, s) in enumerate(zip(lens, starts)):
        for p in range(s, s + n):
            ids.append(3 + (7 * p + 5 * b) % 150)
            pos.append(p)
            slot.append(tables[b][p // block_size] * block_size + p % block_size)
        qs.append(qs[-1] + n)
    i64 = dict(dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        positions_T=torch.tensor(pos, **i64), slot_mapping_T=torch.tensor(slot, **i64),
        block_tables_BM=torch.tensor(tables, **i32), query_start_loc_B1=torch.tensor(qs, **i32),
        seq_lens_B=torch.tensor([s + n for n, s in zip(lens, starts)], **i32), max_query_len=9, max_seq_len=9,
        block_size=block_size)
    return torch.tensor(ids, **i64), meta, [x - 1 for x in qs[1:]]


def _context(model, block_size: int, device: torch.device) -> None:
    """The third sequence's first 7 tokens, written to its blocks 5, 6."""
    i64 = dict(dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        positions_T=torch.arange(7, **i64), slot_mapping_T=torch.tensor([20, 21, 22, 23, 24, 25, 26], **i64),
        block_tables_BM=torch.tensor([[5, 6, -1]], **i32), query_start_loc_B1=torch.tensor([0, 7], **i32),
        seq_lens_B=torch.tensor([7], **i32), max_query_len=7, max_seq_len=7, block_size=block_size)
    with forward_context(meta):
        model(torch.arange(30, 37, **i64), meta.positions_T)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3"])
def test_last_rows_forward_equals_the_full_forward_cpu(family):
    llm = LLM(model=checkpoint(family), dtype="float32", device="cpu", block_size=4, num_kv_blocks=8)
    runner = llm.engine.runner
    model, dev = runner.model, runner.device
    assert model.can_run_last_rows()
    ids_T, meta, last_B = _step(4, dev)
    outs, caches = [], []
    for pruned in (False, True):
        for t in (t for kv in runner.kv_caches for t in kv):  # K and V, or MLA's latent rows
            t.zero_()
        _context(model, 4, dev)
        with torch.inference_mode(), forward_context(meta, last_rows=pruned):
            outs.append(model(ids_T, meta.positions_T))
        caches.append([t.clone() for kv in runner.kv_caches for t in kv])
    full_TD, pruned_BD = outs
    assert full_TD.shape[0] == 16 and pruned_BD.shape[0] == 3
    torch.testing.assert_close(pruned_BD, full_TD[last_B], rtol=1e-5, atol=1e-5)
    for t0, t1 in zip(*caches):  # every row's K/V, in every layer (the last one included)
        assert torch.equal(t0, t1)


def _generate(llm, prompts=PROMPTS, params=PARAMS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.outputs[0].error is None for o in outs), [o.outputs[0].error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def _run(kw: dict, prune: bool, static_buffers: bool):
    """(tokens, routed rows per layer) of two generate calls (the second hits the first's cached prefix)."""
    llm = LLM(**kw, prune_last_layer=prune)
    runner = llm.engine.runner
    assert runner.last_rows is prune
    if static_buffers:  # the padded static-buffer forward the prefill graphs capture (padding sequences)
        runner.extend_graphs = ExtendGraphs(runner.model, 16, 3, -(-runner.max_model_len // 4), 4, runner.device,
                                            capture=False, last_rows=runner.last_rows)
    tokens = _generate(llm) + _generate(llm, [PROMPTS[0] + [77, 78]])
    assert llm.engine.scheduler.num_chunked_prefills > 0 and llm.engine.block_manager.num_prefix_hits > 0
    if static_buffers:
        assert runner.extend_graphs.runs > 0
    return tokens, runner.stats.routed_LE.sum(dim=1)[runner.arch.moe_layer_ids] // runner.arch.top_k  # MoE layers


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_engine_tokens_equal_with_and_without_cpu(family):
    kw = dict(model=checkpoint(family), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=16, max_num_seqs=3)
    want, full_L = _run(kw, False, False)
    assert torch.all(full_L == full_L[0])  # every layer counts every row
    got, pruned_L = _run(kw, True, False)
    assert got == want
    assert torch.equal(pruned_L[:-1], full_L[:-1])
    # the last layer counts one row a sequence a step: every decode row, fewer prompt rows
    decode_rows = (PARAMS.max_tokens - 1) * (len(PROMPTS) + 1)
    assert decode_rows < pruned_L[-1] < full_L[-1]
    for prune, (tokens_want, rows_want) in ((False, (want, full_L)), (True, (got, pruned_L))):
        tokens, rows_L = _run(kw, prune, True)  # through the static buffers: no padding row or sequence counted
        assert tokens == tokens_want
        assert torch.equal(rows_L, rows_want)


@pytest.mark.parametrize("kw", [dict(policy="drop"), dict(routing_trace=True), dict(prune_last_layer=False)],
                         ids=["drop", "trace", "off"])
def test_last_rows_off_where_rows_are_coupled_or_recorded(kw):
    base = dict(model=checkpoint("qwen3_moe"), dtype="float32", device="cpu", block_size=4, num_kv_blocks=16)
    assert LLM(**base).engine.runner.last_rows
    llm = LLM(**base, **kw)
    assert not llm.engine.runner.last_rows


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_cuda_graph_prefill_tokens_equal_with_and_without_gpu(family):
    kw = dict(model=checkpoint(family), device="cuda", dtype="float32", block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=16, max_num_seqs=3)
    got = {}
    for prune in (False, True):
        llm = LLM(**kw, prune_last_layer=prune)
        graphs = llm.engine.runner.extend_graphs
        assert graphs is not None and graphs.last_rows is prune
        got[prune] = _generate(llm) + _generate(llm)  # the second time replays graphs captured before
        assert graphs.disabled is None, graphs.disabled
        assert graphs.runs > 0 and graphs.graphs
    assert got[True] == got[False]
