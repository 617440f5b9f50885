"""Speculative decoding in the engine (moe_infer/engine/speculative/): greedy outputs are those without it.

References: transformers' greedy `generate` for a random tiny checkpoint (tests/tiny_hf.py), the plain engine for the
shipped tiny model (itself checked against transformers in tests/test_tiny_moe.py). Each mode also checks that
speculation happened (tokens proposed and accepted) and that every KV block is free once the requests finish (the
blocks of rejected proposals were rolled back).
"""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import checkpoint, hf_greedy
from moe_infer import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
NUM_NEW = 24
# repetitive prompts (the n-gram proposer finds their continuations) of different lengths
PROMPTS = [
    [7, 19, 33, 41, 58, 62, 77, 80] * 3 + [7, 19],
    [11, 12, 13, 14, 11, 12, 13],
    list(range(40, 70)) + list(range(40, 50)),
]
MODES = {
    "roomy": dict(num_kv_blocks=256, enable_prefix_caching=False),
    "preempt": dict(num_kv_blocks=18, enable_prefix_caching=False),  # the three do not fit at once
    "prefix": dict(num_kv_blocks=256, enable_prefix_caching=True),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=8, enable_prefix_caching=False),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

_REF = {}


def _hf_reference(path):
    if path not in _REF:
        _REF[path] = [hf_greedy(path, p, NUM_NEW)[0] for p in PROMPTS]
    return _REF[path]


def _greedy(logprobs=None, **kw):
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=logprobs, **kw)


def _run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _check_spec_ran_and_freed(llm):
    stats = llm.engine.get_stats()
    assert stats.num_spec_proposed_tokens > 0 and stats.num_spec_accepted_tokens > 0, stats
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "KV blocks leaked"
    assert 0 < stats.spec_acceptance_rate <= 1 and stats.spec_mean_accepted_length > 1


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_matches_transformers(method, mode):
    """A random Qwen3-MoE checkpoint: the tokens equal transformers' greedy ones. The draft model is the target's
    own weights, so that every proposal must be accepted: a draft KV slot written wrong (preemption, prefix-cache
    hits, chunked prompts, rolled-back blocks reused) shows as a rejection. k fixed (adaptive k would stop proposing:
    a draft as large as the target costs a target step per proposal)."""
    path = checkpoint("qwen3_moe")
    spec = NGRAM if method == "ngram" else {"method": "draft", "num_speculative_tokens": 3, "draft_model": path,
                                            "adaptive": False}
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, speculative_config=spec, **MODES[mode])
    if mode == "prefix":
        _run(llm, PROMPTS[:1], _greedy())
    outs = _run(llm, PROMPTS, _greedy())
    for i, (out, want) in enumerate(zip(outs, _hf_reference(path))):
        assert out.outputs[0].token_ids == want, f"prompt {i}: {out.outputs[0].token_ids} != HF {want}"
    _check_spec_ran_and_freed(llm)
    stats = llm.engine.get_stats()
    if method == "draft":
        assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens
    if mode == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    if mode == "prefix":
        assert llm.engine.block_manager.num_prefix_hits > 0


def test_draft_of_another_family():
    """A Mixtral draft (other family, other weights, same vocabulary) for the Qwen3-MoE target: its proposals are
    mostly rejected, and the tokens are still transformers' greedy ones."""
    path = checkpoint("qwen3_moe")
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256,
              speculative_config={"method": "draft", "num_speculative_tokens": 2, "adaptive": False,
                                  "draft_model": checkpoint("mixtral", num_hidden_layers=2)})
    outs = _run(llm, PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == _hf_reference(path)
    stats = llm.engine.get_stats()
    assert stats.num_spec_proposed_tokens > 0 and stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.fixture(scope="module")
def tiny_pair():
    """The shipped tiny model without and with n-gram speculation."""
    kw = dict(device="cpu", block_size=BLOCK, num_kv_blocks=128)
    return LLM(**kw), LLM(speculative_config=NGRAM, **kw)


def _same(a, b, logprobs=False):
    for x, y in zip(a, b):
        cx, cy = x.outputs, y.outputs
        assert [c.token_ids for c in cx] == [c.token_ids for c in cy]
        assert [c.text for c in cx] == [c.text for c in cy]
        assert [(c.finish_reason, c.stop_reason) for c in cx] == [(c.finish_reason, c.stop_reason) for c in cy]
        if logprobs:
            for c, d in zip(cx, cy):
                assert len(c.logprobs) == len(d.logprobs) == len(c.token_ids)
                for e, f in zip(c.logprobs, d.logprobs):
                    assert list(e) == list(f)
                    torch.testing.assert_close(torch.tensor([v.logprob for v in e.values()]),
                                               torch.tensor([v.logprob for v in f.values()]), atol=1e-4, rtol=1e-4)


TEXT_PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "the cat sat on the mat. the cat sat on"]


def test_tiny_model_outputs_equal_with_logprobs_and_n(tiny_pair):
    plain, spec = tiny_pair
    params = [_greedy(logprobs=3), SamplingParams(temperature=0.0, max_tokens=NUM_NEW, n=2, ignore_eos=True)]
    for p in params:
        _same(plain.generate(TEXT_PROMPTS, p, use_tqdm=False), spec.generate(TEXT_PROMPTS, p, use_tqdm=False),
              logprobs=p.logprobs is not None)
    _check_spec_ran_and_freed(spec)


def test_tiny_model_stops(tiny_pair):
    """Stop strings and stop tokens inside a run of accepted proposals: the tokens after the stop are cut, as the
    plain engine never produced them; max_tokens likewise."""
    plain, spec = tiny_pair
    free = plain.generate(TEXT_PROMPTS, _greedy(), use_tqdm=False)
    for i, out in enumerate(free):
        c = out.outputs[0]
        stop_str = c.text[5:8]
        assert stop_str, c.text
        cases = [SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop=[stop_str]),
                 SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop_token_ids=[c.token_ids[6]]),
                 SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                 SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop=[stop_str], include_stop_str_in_output=True)]
        for p in cases:
            a = plain.generate(TEXT_PROMPTS[i], p, use_tqdm=False)
            b = spec.generate(TEXT_PROMPTS[i], p, use_tqdm=False)
            _same(a, b)
    _check_spec_ran_and_freed(spec)


@pytest.mark.parametrize("graphs", [False, True])
def test_seeded_sampling_is_reproducible(graphs):
    """A seeded request gives the same tokens in two runs and alone or beside others (k fixed: adaptive off). graphs:
    through the decode graphs' buffers (capture=False on the CPU), where proposals shorter than k are filled up to k
    so that verify steps replay a graph: a seeded sampling request is never filled (whether it is would depend on the
    batch: its draws, and so its tokens, with it)."""
    from moe_infer.engine.cuda_graph import DecodeGraphs

    path = checkpoint("qwen3_moe")
    spec = {**NGRAM, "adaptive": False}
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256, max_num_seqs=4,
              speculative_config=spec)
    runner = llm.engine.runner
    if graphs:
        runner.graphs = DecodeGraphs(runner.model, 4, -(-runner.max_model_len // BLOCK), BLOCK, runner.device,
                                     capture=False, lm_head=runner.model.lm_head, max_query_len=4, max_verify_batch=4)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=NUM_NEW, ignore_eos=True, seed=7)
    other = SamplingParams(temperature=1.0, max_tokens=NUM_NEW, ignore_eos=True)
    alone = _run(llm, PROMPTS[:1], seeded)[0].outputs[0].token_ids
    again = _run(llm, PROMPTS[:1], seeded)[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [seeded, other, other], use_tqdm=False)
    assert alone == again == batch[0].outputs[0].token_ids
    assert llm.engine.get_stats().num_spec_proposed_tokens > 0
    assert not graphs or runner.graphs.verify_runs > 0


def test_bad_configs_are_refused():
    from moe_infer.config import SpeculativeConfig

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative.method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="unknown keys"):
        LLM(device="cpu", speculative_config={"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ValueError, match=r"under a mesh \(parallel.tp=2"):
        LLM(device="cpu", tp=2, speculative_config=NGRAM)
    with pytest.raises(ValueError, match="vocabulary of 200 tokens"):
        LLM(model=checkpoint("qwen3_moe"), device="cpu", num_kv_blocks=64,
            speculative_config={"method": "draft", "draft_model": checkpoint("mixtral", vocab_size=200)})
    with pytest.raises(ValueError, match="mtp"):
        LLM(device="cpu", num_kv_blocks=64, speculative_config={"method": "mtp"})


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_rejected_proposals_blocks_are_rolled_back(method):
    """After every step a running sequence holds no block past those of its tokens: the blocks taken for
    rejected proposals (and, with a draft, for its proposals' KV) went back to the free list at once."""
    path = checkpoint("qwen3_moe")
    spec = NGRAM if method == "ngram" else {"method": "draft", "num_speculative_tokens": 3,
                                            "draft_model": checkpoint("mixtral", num_hidden_layers=2)}
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=2, num_kv_blocks=256,
              enable_prefix_caching=False, speculative_config={**spec, "adaptive": False})
    engine, bm = llm.engine, llm.engine.block_manager
    for p in PROMPTS[:2]:
        engine.add_request({"prompt_token_ids": p}, _greedy())
    rejected = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= bm.blocks_needed(len(seq)), (seq, seq.block_table)
            held = {b for s in engine.scheduler.running for b in s.block_table}
            assert bm.num_free_blocks == bm.num_blocks - len(held)
        stats = engine.get_stats()
        rejected = stats.num_spec_proposed_tokens - stats.num_spec_accepted_tokens
    assert rejected > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_verify_steps_through_the_prefill_graph_buffers_cpu():
    """Verify steps (k + 1 rows a sequence, every one sampled) through ExtendGraphs' padded static buffers
    (capture=False on the CPU: the layout the GPU's captured graphs read) give transformers' tokens."""
    from moe_infer.engine.extend_graph import ExtendGraphs

    path = checkpoint("qwen3_moe")
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256, max_num_seqs=4,
              max_num_batched_tokens=64, speculative_config={**NGRAM, "adaptive": False})
    runner = llm.engine.runner
    # buffers for 3 sequences (4 with the padding one), up to 64 sampling rows (one a sequence would be 4)
    runner.extend_graphs = ExtendGraphs(runner.model, 64, 2, -(-runner.max_model_len // BLOCK), BLOCK, runner.device,
                                        capture=False, last_rows=runner.last_rows, max_sample_rows=64, min_bucket=4)
    assert runner.extend_graphs.sizes[:3] == [4, 8, 16]  # a verify step of one sequence is not padded to 16 rows
    assert not runner.last_rows  # a verify step reads every proposal's row
    seen = []
    load = runner.extend_graphs.load

    def spy(flat, sizes, num_extra):
        seen.append(sizes)
        return load(flat, sizes, num_extra)

    runner.extend_graphs.load = spy
    outs = _run(llm, PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == _hf_reference(path)
    assert any(S > 4 for _, B, S, *_ in seen), "no verify step of many rows went through the static buffers"
    _check_spec_ran_and_freed(llm)
    # buffers sized for one sampling row a sequence decline such a step (it runs eagerly) rather than fail
    small = ExtendGraphs(runner.model, 64, 4, 8, BLOCK, runner.device, capture=False)
    assert not small.can_run((12, 3, 9, 2, 4, 12))


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_gpu_graphs(method):
    """On the GPU (float32): transformers' greedy tokens with the verify steps replayed as CUDA graphs (the prefill
    graphs) and, with a draft, the draft's own decode graphs; no KV block leaked."""
    path = checkpoint("qwen3_moe")
    spec = NGRAM if method == "ngram" else {"method": "draft", "num_speculative_tokens": 3, "draft_model": path,
                                            "adaptive": False}
    llm = LLM(model=path, dtype="float32", device="cuda", block_size=BLOCK, num_kv_blocks=256,
              speculative_config=spec)
    graphs = llm.engine.runner.extend_graphs
    assert graphs is not None and graphs.sizes[0] == 4  # small verify steps: small buckets (padding rows read experts)
    outs = _run(llm, PROMPTS, _greedy())
    want = [hf_greedy(path, p, NUM_NEW, device="cuda")[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert graphs.disabled is None and graphs.graphs, graphs.disabled
    _check_spec_ran_and_freed(llm)
    if method == "draft":  # the draft's decode kernels and the verify step's prefill kernels round apart: near-ties
        stats = llm.engine.get_stats()
        assert stats.num_spec_accepted_tokens >= 0.9 * stats.num_spec_proposed_tokens


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_verify_steps_replay_decode_graphs_gpu():
    """On the GPU (float32): verify steps of k + 1 tokens every sequence replay the decode graphs' verify graphs
    (attention over the k + 1 queries inside the graph); greedy tokens equal the plain engine's and transformers'."""
    path = checkpoint("qwen3_moe")
    kw = dict(model=path, dtype="float32", device="cuda", block_size=BLOCK, num_kv_blocks=256)
    llm = LLM(**kw, speculative_config={**NGRAM, "adaptive": False})
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.max_query_len == 4 and graphs.max_verify_batch >= 4
    outs = [o.outputs[0].token_ids for o in _run(llm, PROMPTS, _greedy())]
    assert graphs.disabled is None, graphs.disabled
    assert graphs.verify_runs > 0 and any(len(key) == 4 for key in graphs.graphs), (graphs.verify_runs, graphs.graphs)
    # plain decode steps beside them: launched with lookahead (input ids from the step in flight) into the same graphs
    assert llm.engine.executor.num_lookahead_steps > 0 and graphs.runs > graphs.verify_runs
    plain = LLM(**kw)
    assert outs == [o.outputs[0].token_ids for o in _run(plain, PROMPTS, _greedy())]
    assert outs == [hf_greedy(path, p, NUM_NEW, device="cuda")[0] for p in PROMPTS]
    _check_spec_ran_and_freed(llm)


def test_draft_catches_up_a_long_prompt_in_chunks():
    """A prompt longer than the token budget reaches the draft in chunks (as the target's chunked prefill): the draft
    is the target's weights, so every proposal must still be accepted, and the tokens are HF's."""
    path = checkpoint("qwen3_moe")
    prompt = list(range(3, 60)) + list(range(3, 30))  # 84 tokens, budget 16
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256,
              max_num_batched_tokens=16, enable_prefix_caching=False,
              speculative_config={"method": "draft", "num_speculative_tokens": 2, "draft_model": path,
                                  "adaptive": False})
    steps = []
    proposer = llm.engine.speculator.proposer
    catch_up = proposer._catch_up

    def spy(live, starts):
        before = list(starts)
        catch_up(live, starts)
        steps.append([b - a for a, b in zip(before, starts)])

    proposer._catch_up = spy
    out = _run(llm, [prompt], _greedy())[0].outputs[0].token_ids
    assert out == hf_greedy(path, prompt, NUM_NEW)[0]
    assert any(sum(s) > 0 for s in steps)  # the long prompt went through the chunks
    stats = llm.engine.get_stats()
    assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens > 0


def test_verify_steps_through_the_decode_graph_buffers_cpu():
    """Verify steps of k + 1 tokens every sequence through DecodeGraphs' padded static buffers (capture=False on the
    CPU: the layout the GPU's captured graphs read, padding sequences included), the LM head over every row, give
    transformers' tokens; proposals shorter than k are filled so that the steps are uniform."""
    from moe_infer.engine.cuda_graph import DecodeGraphs

    path = checkpoint("qwen3_moe")
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256, max_num_seqs=4,
              max_num_batched_tokens=64, speculative_config={**NGRAM, "adaptive": False})
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, 4, -(-runner.max_model_len // BLOCK), BLOCK, runner.device,
                                 capture=False, lm_head=runner.model.lm_head, max_query_len=4, max_verify_batch=4)
    seen = []
    load = runner.graphs.load

    def spy(flat, sizes, num_extra):
        seen.append(sizes)
        return load(flat, sizes, num_extra)

    runner.graphs.load = spy
    spec = llm.engine.speculator
    record, verify_steps = spec.record, []

    def count(plan, tokens):  # verify steps of k + 1 = 4 tokens every sequence (no prompt chunk beside them; no
        if any(s.spec_token_ids for s in plan.seqs) and all(len(s.token_ids) == 4 for s in plan.seqs):
            verify_steps.append(len(plan.seqs))  # sequence whose max_tokens leaves fewer than k proposals)
        record(plan, tokens)

    spec.record = count
    outs = _run(llm, PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == _hf_reference(path)
    assert runner.graphs.verify_runs > 0
    # plain decode steps with lookahead (placeholder inputs taken from the step in flight) through the same buffers
    assert llm.engine.executor.num_lookahead_steps > 0 and runner.graphs.runs > runner.graphs.verify_runs
    # a prompt without repeats: its sequence proposes nothing until its output repeats, and is filled up to k
    # beside the others (the graphs took every uniform verify step)
    odd = list(range(100, 112))
    verify_steps.clear()
    before = runner.graphs.verify_runs
    outs = _run(llm, [PROMPTS[0], odd], _greedy())
    assert [o.outputs[0].token_ids for o in outs] == [_hf_reference(path)[0], hf_greedy(path, odd, NUM_NEW)[0]]
    assert len(verify_steps) > 0 and runner.graphs.verify_runs - before == len(verify_steps)
    # 3 sequences (padded to 4) of 4 tokens each went through the buffers
    assert (12, 3, 12, max(s[3] for s in seen if s[:3] == (12, 3, 12)), 4) in [s[:5] for s in seen]
    _check_spec_ran_and_freed(llm)
    # a step of uneven queries, or one whose rows do not all sample, is not a verify step of the graphs
    assert not runner.graphs.can_run((10, 3, 10, 2, 4, 12)) and not runner.graphs.can_run((12, 3, 3, 2, 4, 12))
    assert not runner.graphs.can_run((10, 2, 10, 2, 5, 12))  # 5 tokens a sequence: over max_query_len


@pytest.mark.timeout(900)  # the interpreter runs every attention call
def test_verify_steps_through_the_decode_graph_buffers_triton_interpreter():
    """The same through the paged Triton kernel (its grid from the bucket: q queries a sequence, padding sequences
    of q rows over block 0), as the GPU's verify graphs launch it: transformers' greedy tokens."""
    pytest.importorskip("moe_infer.layers.attention_triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU test captures the real graphs")
    from moe_infer.engine.cuda_graph import DecodeGraphs
    from moe_infer.engine.speculative.graphs import verify_graph_shape

    path = checkpoint("qwen3_moe")
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=64, attention_backend="triton",
              speculative_config={**NGRAM, "adaptive": False})
    runner = llm.engine.runner
    assert verify_graph_shape(llm.engine.cfg, runner.model, 4) == (4, 4)  # a static-launch backend: verify graphs
    runner.graphs = DecodeGraphs(runner.model, 4, -(-runner.max_model_len // BLOCK), BLOCK, runner.device,
                                 capture=False, lm_head=runner.model.lm_head, max_query_len=4, max_verify_batch=4)
    prompts = PROMPTS[:2]
    n = 16  # with async scheduling a proposal is verified a step later than without: 10 tokens held no verify step
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    assert runner.graphs.verify_runs > 0
    assert [o.outputs[0].token_ids for o in outs] == [t[:n] for t in _hf_reference(path)[:2]]
