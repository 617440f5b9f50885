"""Routing traces: the file format round-trips, bad files fail clearly, and the engine's recorder writes
what the router chose (checked against transformers' own router on the tiny model)."""
import json

import numpy as np
import pytest
import torch

from moe_infer.routing.trace import RoutingTrace, load_trace, save_trace
from moe_infer.routing.trace_recorder import RoutingTraceRecorder


def _trace(E=300, L=3, T=50, K=4, logits=True, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(L)])
    w = rng.random((L, T, K)).astype(np.float32)
    return RoutingTrace(ids, w / w.sum(-1, keepdims=True), np.repeat(np.arange(5), T // 5), E, [1, 3, 5],
                        position_T=np.arange(T) % 7, router_logits_LTE=rng.standard_normal((L, T, E)) if logits else None,
                        info={"model": "m", "prompts": ["a", "b"], "policy": {"policy": "drop"}, "commit": "abc"})


@pytest.mark.parametrize("E", [16, 300, 40000])
def test_round_trip(tmp_path, E):
    tr = _trace(E=E, logits=E < 1000)
    path = str(tmp_path / "t.safetensors")
    save_trace(tr, path)
    back = load_trace(path)
    assert (back.topk_ids_LTK == tr.topk_ids_LTK).all()
    np.testing.assert_allclose(back.topk_weights_LTK, tr.topk_weights_LTK, atol=1e-3)  # float16 on disk
    assert (back.step_T == tr.step_T).all() and (back.position_T == tr.position_T).all()
    assert back.num_experts == E and back.moe_layers == [1, 3, 5] and back.info == tr.info
    if tr.router_logits_LTE is not None:
        assert (back.router_logits_LTE == tr.router_logits_LTE.astype(np.float32)).all()
    from safetensors import safe_open

    with safe_open(path, "numpy") as f:  # the documented compact id type
        assert f.get_tensor("topk_ids_LTK").dtype == {16: np.uint8, 300: np.int16, 40000: np.int32}[E]


def test_bad_files_are_clear_errors(tmp_path):
    garbage = tmp_path / "g.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read routing trace"):
        load_trace(str(garbage))
    from safetensors.numpy import save_file

    other = str(tmp_path / "o.safetensors")
    save_file({"x": np.zeros(3)}, other, metadata={"format": "something"})
    with pytest.raises(ValueError, match="not a routing trace"):
        load_trace(other)
    with pytest.raises(ValueError, match="outside"):
        RoutingTrace(np.full((1, 2, 1), 5), np.ones((1, 2, 1)), [0, 0], 4, [0])
    with pytest.raises(ValueError, match="non-decreasing"):
        RoutingTrace(np.zeros((1, 2, 1)), np.ones((1, 2, 1)), [1, 0], 4, [0])


def test_recorder_steps_chunks_truncation_and_failed_steps():
    rec = RoutingTraceRecorder([0, 2], num_experts=8, top_k=2, device="cpu", max_tokens=10, chunk_tokens=4)
    ids = [torch.tensor([[i % 8, (i + 1) % 8] for i in range(t)], dtype=torch.int32) for t in (3, 3, 2, 4)]
    for step, ids_TK in enumerate(ids[:3]):  # 3 + 3 + 2 rows: chunks of 4 roll over
        rec.begin_step(torch.arange(ids_TK.shape[0]), ids_TK.shape[0])
        for layer in (0, 2):
            rec.record(layer, ids_TK + layer, torch.full(ids_TK.shape, 0.5))
    rec.begin_step(None, 1)  # a forward that raised after the first MoE layer: discarded
    rec.record(0, torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2))
    rec.begin_step(None, 4)  # 8 + 4 > max_tokens: not recorded
    rec.record(0, ids[3], torch.ones(4, 2))
    tr = rec.trace({"x": 1})
    assert tr.num_tokens == 8 and tr.info["truncated"] and tr.info["x"] == 1
    assert tr.step_T.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert tr.topk_ids_LTK[1].tolist() == (torch.cat(ids[:3]) + 2).tolist()
    assert tr.position_T.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="routed 3 tokens, the step has 2"):
        rec.begin_step(None, 2)
        rec.record(0, ids[0], torch.ones(3, 2))


@pytest.mark.timeout(300)
def test_engine_trace_is_the_routers_choice_and_matches_the_statistics(tmp_path):
    """The prefill rows of the trace equal transformers' Qwen3-MoE router top-2 on the same prompt."""
    transformers = pytest.importorskip("transformers")
    from moe_infer import LLM, SamplingParams
    from moe_infer.assets import default_model_path

    llm = LLM(routing_trace=True, routing_trace_logits=True, num_kv_blocks=64)
    prompts = ["def fibonacci(n):\n    return", "class Stack:"]
    llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    path = str(tmp_path / "t.safetensors")
    tr = llm.save_routing_trace(path, prompts=prompts)
    tr = load_trace(path)
    assert tr.info["prompts"] == prompts and tr.info["policy"]["policy"] == "dropless" and tr.info["commit"]
    load = llm.get_expert_load()
    for layer, row in enumerate(load):
        assert np.bincount(tr.topk_ids_LTK[layer].ravel(), minlength=16).tolist() == row["routed"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = llm.get_tokenizer()(prompts[0])["input_ids"]
    with torch.no_grad():
        router = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    first = tr.step_T == 0  # the first step prefilled both prompts, the first prompt's tokens first
    rows = np.flatnonzero(first)[:len(ids)]
    assert tr.position_T[rows].tolist() == list(range(len(ids)))
    for layer, logits in enumerate(router):
        probs = torch.softmax(logits.reshape(len(ids), -1).float(), -1)
        w, e = probs.topk(2, dim=-1)
        assert tr.topk_ids_LTK[layer, rows].tolist() == e.tolist()
        np.testing.assert_allclose(tr.topk_weights_LTK[layer, rows], (w / w.sum(-1, keepdim=True)).numpy(), atol=2e-3)
        np.testing.assert_allclose(tr.router_logits_LTE[layer, rows], logits.reshape(len(ids), -1).numpy(), atol=1e-4)
    json.dumps(tr.info)  # metadata stays JSON


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_engine_trace_on_cuda_rolls_chunks_over_and_matches_the_statistics():
    """On CUDA the recorder copies full chunks to pinned host memory asynchronously; small chunks force
    several roll-overs. Decode steps run eagerly while recording (no CUDA graphs)."""
    from moe_infer import LLM, SamplingParams

    llm = LLM(routing_trace=True, device="cuda", num_kv_blocks=256)
    assert llm.engine.runner.graphs is None
    llm.engine.runner.trace.chunk_tokens = 16
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    tr = llm.get_routing_trace()
    assert tr.info["device"].startswith("cuda") and tr.num_tokens > 8 * 24
    assert (np.diff(tr.step_T) >= 0).all() and tr.step_T.max() >= 23
    for layer, row in enumerate(llm.get_expert_load()):
        assert np.bincount(tr.topk_ids_LTK[layer].ravel(), minlength=tr.num_experts).tolist() == row["routed"]
