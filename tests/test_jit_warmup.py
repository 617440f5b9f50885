"""No Triton compile after start-up (moe_infer/engine/warmup.py, the kernels' `do_not_specialize`).

CPU (launches recorded instead of run: tests/launch_keys.py): every Triton specialization key that steps of
any size select is one the start-up warm-up already selected:
  - the MoE path (fused gate + fused experts) at tuned H100 shapes, every token count up to 4096;
  - the engine: a tiny model under the Triton backends, `warmup_plan`'s forwards, then real steps through
    LLM.generate (prefills of odd lengths, chunked and mixed steps, decodes of every batch size).
GPU: an engine of the Qwen3-30B-A3B layer shape started as users start it, then steps of many sizes and
shapes with Triton's compile hook counting: zero compiles.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from launch_keys import LaunchKeys, count_compiles, no_specialize, shapes_of
from moe_infer.engine.warmup import moe_config_of, warmup_context_lengths, warmup_decode_shapes, warmup_token_counts

pytestmark = pytest.mark.timeout(300)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H100 = "NVIDIA_H100_80GB_HBM3"  # the tuned config tables the sweep selects from (CPU has none of its own)


def test_warmup_token_counts():
    assert warmup_token_counts(16, 1, lambda T: None) == [1, 2, 3, 4, 5, 8, 9, 16]  # 2^k and 2^k + 1
    assert warmup_token_counts(20, 1, lambda T: T >= 11) == [1, 2, 3, 4, 5, 8, 9, 11, 16, 17]  # a config change
    assert 6 in warmup_token_counts(20, 6, lambda T: None)  # N = 36 starts (32, 64]: not a power of two of T
    assert warmup_token_counts(1, 8, lambda T: None) == [1]
    assert warmup_context_lengths(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    with pytest.raises(ValueError, match="positive"):
        warmup_token_counts(0, 1, lambda T: None)


@pytest.mark.parametrize("heads,key_bytes,sms", [(4, 256, 132), (1, 512, 132), (8, 256, 78), (2, 64, 4)])
def test_warmup_decodes_cover_every_decode_tile_pair(heads, key_bytes, sms):
    """Every (split count, key tile) that a decode of 1..24 sequences over 1..3000 keys selects (all of them
    enumerated) is one of the warm-up decodes' (at its few edge lengths)."""
    from moe_infer.kernels.paged_attention import decode_block_n, num_splits

    def variant(B, L):
        s = num_splits(B * heads, L, 1, sms)
        return s, decode_block_n(B * heads, L, s, sms, key_bytes)

    shapes = warmup_decode_shapes(24, 3000, variant)
    assert len(shapes) < 60 and (1, 3000) in shapes and (1, 1) in shapes
    warmed = {variant(B, L) for B, L in shapes}
    every = {variant(B, L) for B in range(1, 25) for L in range(1, 3001)}
    assert every == warmed, sorted(every - warmed)
    with pytest.raises(ValueError, match="positive"):
        warmup_decode_shapes(0, 10, variant)


def test_do_not_specialize_names_are_kernel_arguments():
    """Triton ignores a do_not_specialize name that is not a (non-constexpr) argument: a typo would go unseen."""
    import inspect

    from moe_infer.kernels import jit_kernels

    listed = {k.fn.__name__: no_specialize(k) for k in jit_kernels() if no_specialize(k)}
    assert {"tile_scatter_kernel", "tile_hist_kernel", "paged_attention_kernel", "rope_store_kv_kernel"} <= set(listed)
    for kernel in jit_kernels():
        params = inspect.signature(kernel.fn).parameters
        for name in no_specialize(kernel):
            assert name in params and "constexpr" not in str(params[name].annotation), (kernel.fn.__name__, name)


def _moe_inputs(E: int, F: int, D: int, max_tokens: int):
    w13_E2FD = torch.empty(E, 2 * F, D, dtype=torch.bfloat16, device=DEVICE)  # never read: launches are recorded
    w2_EDF = torch.empty(E, D, F, dtype=torch.bfloat16, device=DEVICE)
    x_TD = torch.empty(max_tokens, D, dtype=torch.bfloat16, device=DEVICE)
    logits_TE = torch.empty(max_tokens, E, dtype=torch.bfloat16, device=DEVICE)
    return w13_E2FD, w2_EDF, x_TD, logits_TE


@pytest.mark.parametrize("E,F,D,K", [(128, 768, 2048, 8), (8, 14336, 4096, 2), (64, 1408, 2048, 6)],
                         ids=["qwen3-30b-a3b", "mixtral-8x7b", "untuned-k6"])
def test_moe_steps_of_any_size_select_warmed_variants(monkeypatch, E, F, D, K):
    """gate + fused experts at every T in 1..4096 select only keys of the warm-up's token counts."""
    from moe_infer.experts.triton_experts import experts_triton
    from moe_infer.kernels import fused_moe_config
    from moe_infer.kernels.fused_moe import fused_experts
    from moe_infer.routing.spec import RoutingSpec
    from moe_infer.routing.triton_select import select_experts_triton

    if DEVICE == "cpu":
        monkeypatch.setattr(fused_moe_config, "device_name", lambda: H100)
    max_tokens = 4096
    w13_E2FD, w2_EDF, x_TD, logits_TE = _moe_inputs(E, F, D, max_tokens)
    spec = RoutingSpec(num_experts=E, top_k=K)
    layer = SimpleNamespace(spec=spec, store=SimpleNamespace(weights=lambda: (w13_E2FD, w2_EDF)))
    recorder = LaunchKeys(monkeypatch)

    def step(T: int) -> None:
        recorder.where = f"T={T}"
        weights_TK, ids_TK = select_experts_triton(logits_TE[:T], spec)
        fused_experts(x_TD[:T], ids_TK, weights_TK, w13_E2FD, w2_EDF)

    for T in warmup_token_counts(max_tokens, K, moe_config_of([layer], experts_triton)):
        step(T)
    warmed = dict(recorder.keys)
    for T in range(1, max_tokens + 1):
        step(T)
    new = recorder.new_since(warmed)
    assert not new, f"{len(new)} kernel variants the warm-up did not compile:\n{shapes_of(new)}"


def _engine_workload(llm, recorder, max_len: int) -> None:
    """Steps of many sizes and shapes through the real engine: prefills of odd lengths then a decode at
    their odd context lengths, chunked prefills beside decodes, decodes of every batch size."""
    from moe_infer import SamplingParams

    rng = random.Random(0)

    def run(name, prompts, max_tokens):
        recorder.where = name
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(o.outputs[0].error is None for o in outs), [o.outputs[0].error for o in outs]

    def prompt(n):
        return [rng.randrange(3, 150) for _ in range(n)]

    lengths = {1, 2, 3, 7, 13, 33, 67, 127, 129, 255, 333, 511, 513, 777, 1023, 1025, 1500, 2047, 2049, max_len - 3}
    lengths = sorted({n for n in lengths if n < max_len - 2} | {rng.randrange(1, max_len - 2) for _ in range(12)})
    for n in lengths:
        run(f"prefill of {n} tokens, then a decode", [prompt(n)], [2])
    mixed = [rng.randrange(1, max_len // 2) for _ in range(8)]
    run(f"chunked and mixed steps, prompts {mixed}", [prompt(n) for n in mixed], [rng.randrange(1, 24) for _ in mixed])
    batch = llm.engine.cfg.scheduler.max_num_seqs
    run(f"decodes of batch {batch} down to 1", [prompt(rng.randrange(1, 40)) for _ in range(batch)],
        [3 * (i + 1) for i in range(batch)])


@pytest.mark.timeout(600)
def test_engine_steps_select_warmed_variants_cpu(monkeypatch):
    """The engine's own warm-up plan, then real steps: no launch key the warm-up did not have."""
    from engine_fixtures import checkpoint
    from moe_infer import LLM
    from moe_infer.engine.warmup import warmup_kernels, warmup_plan

    if DEVICE != "cpu":
        pytest.skip("the GPU test below counts real compiles")
    max_len = 4096
    llm = LLM(model=checkpoint("qwen3_moe", max_position_embeddings=max_len), device="cpu", dtype="float32",
              routing_backend="triton", experts_backend="triton", attention_backend="triton", collect_stats=False,
              max_num_seqs=8, max_num_batched_tokens=max_len, block_size=16, num_kv_blocks=8 * max_len // 16 + 8,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    recorder = LaunchKeys(monkeypatch)
    recorder.where = "warm-up"
    counts, decodes, last_row_shapes = warmup_plan(runner)
    warmup_kernels(runner.model, counts, decodes, runner.max_model_len, runner.block_size, runner.device,
                   runner.last_rows, last_row_shapes)
    warmed = dict(recorder.keys)
    launched = {key[0] for key in warmed}
    assert {"routing_gate_kernel", "gate_up_kernel", "down_kernel", "align_scatter_kernel", "tile_scatter_kernel",
            "rope_store_kv_kernel", "paged_attention_kernel", "paged_attention_reduce_kernel"} <= launched, launched
    _engine_workload(llm, recorder, max_len)
    new = recorder.new_since(warmed)
    assert not new, f"{len(new)} kernel variants the warm-up did not compile:\n{shapes_of(new)}"


# Qwen3-30B-A3B's layer shape (its tuned fused MoE configs), 2 layers, a small vocabulary
REAL = dict(vocab_size=4096, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
            head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
            norm_topk_prob=True, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            eos_token_id=0, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)


@pytest.mark.gpu
@pytest.mark.timeout(900)  # the first start-up of a process compiles every variant (~1 min on an H100)
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_no_triton_compile_after_startup_gpu(tmp_path, enforce_eager):
    """Graphs: decodes and steps up to 1024 tokens replay (each new bucket's capture runs it eagerly once),
    larger steps run eagerly at their exact size; eager: every step at its exact size and context."""
    from transformers import Qwen3MoeConfig

    from moe_infer import LLM

    Qwen3MoeConfig(**REAL).save_pretrained(tmp_path)
    max_len, max_seqs = REAL["max_position_embeddings"], 32
    llm = LLM(model=str(tmp_path), load_format="dummy", device="cuda", dtype="bfloat16", max_num_seqs=max_seqs,
              max_num_batched_tokens=max_len, cuda_graph_max_tokens=1024, enforce_eager=enforce_eager,
              num_kv_blocks=max_seqs * max_len // 16 + 16, block_size=16, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.warmup_s is not None
    assert (runner.graphs is None) == enforce_eager and (runner.extend_graphs is None) == enforce_eager
    print(f"\nwarm-up at start-up: {runner.warmup_s:.1f} s (enforce_eager={enforce_eager})")
    recorder = SimpleNamespace(where="")
    with count_compiles(lambda: recorder.where) as compiled:
        _engine_workload(llm, recorder, max_len)
    if not enforce_eager:
        assert runner.graphs.runs > 0 and runner.extend_graphs.runs > 0 and runner.graphs.disabled is None
    assert not compiled, f"{len(compiled)} Triton compiles after start-up:\n{shapes_of(compiled)}"
