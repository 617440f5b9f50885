"""The fused rotary + K/V-write kernel (`moe_infer.kernels.rope_kv`) against transformers'
`apply_rotary_pos_emb` with cos/sin from transformers' own rotary class and a naive per-slot loop
writing the cache: bit for bit, in bfloat16, float16 and float32 (interpreter on CPU, CUDA with -m gpu).
In the engine, the fused path against the unfused one (same logprobs, bit for bit) and the torch backend.

Legend: T tokens, H query heads, Hkv KV heads, d head_dim, P table positions, Nb cache blocks, S block size.
"""
from __future__ import annotations

import os

import pytest
import torch

from moe_infer.layers.paged_attention import store_kv
from moe_infer.layers.rotary import RotaryEmbedding, rope_store_kv_ref

pytestmark = pytest.mark.timeout(120)

kernels = pytest.importorskip("moe_infer.kernels.rope_kv")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1", allow_module_level=True)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6}


def _hf_config(H, Hkv, d, P, rope=None):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=H * d, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=d,
                          max_position_embeddings=P, rope_parameters=rope or {"rope_type": "default", "rope_theta": 1e6})


def _hf_rotate(config, q_THd, k_THd, positions_T):
    """transformers' Qwen3-MoE rotary class (cos/sin) and apply_rotary_pos_emb on [T, H, d]."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding, apply_rotary_pos_emb

    rope = Qwen3MoeRotaryEmbedding(config).to(q_THd.device)
    cos_1Td, sin_1Td = rope(q_THd, positions_T[None])
    return apply_rotary_pos_emb(q_THd, k_THd, cos_1Td[0], sin_1Td[0], unsqueeze_dim=1)


def _case(T, H, Hkv, d, Nb, S, P, dtype, seed=0):
    """Strided q, k, v (views of one fused projection), positions with 0 and P - 1, distinct slots with
    padding rows (-1), caches full of NaN (a slot never written stays NaN)."""
    g = torch.Generator().manual_seed(seed)
    qkv_TX = (4 * torch.randn(T, (H + 2 * Hkv) * d, generator=g)).to(dtype).to(DEV)
    q, k, v = qkv_TX.split([H * d, Hkv * d, Hkv * d], dim=-1)
    q_THd, k_THd, v_THd = q.view(T, H, d), k.view(T, Hkv, d), v.view(T, Hkv, d)
    assert not q_THd.is_contiguous() and not k_THd.is_contiguous()
    positions_T = torch.randint(0, P, (T,), generator=g)
    positions_T[0], positions_T[-1] = 0, P - 1
    slots_T = torch.randperm(Nb * S, generator=g)[:T]
    slots_T[1::3] = -1
    k_cache = torch.full((Nb, S, Hkv, d), float("nan"), dtype=dtype, device=DEV)
    return q_THd, k_THd, v_THd, positions_T.to(DEV), slots_T.to(DEV), k_cache, k_cache.clone()


def _naive_store(k_THd, v_THd, k_cache, v_cache, slots_T):
    for t, slot in enumerate(slots_T.tolist()):
        if slot >= 0:
            S = k_cache.shape[1]
            k_cache[slot // S, slot % S] = k_THd[t]
            v_cache[slot // S, slot % S] = v_THd[t]


def _same(a, b):
    """Bit-identical, NaN (never-written slots) included."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                              b.view(torch.int16 if b.element_size() == 2 else torch.int32))


def _check_against_hf(T, H, Hkv, d, dtype, rope=None, Nb=6, S=4, P=64, seed=0):
    config = _hf_config(H, Hkv, d, P, rope)
    rotary = RotaryEmbedding(config, d).to(DEV)
    q_THd, k_THd, v_THd, positions_T, slots_T, k_cache, v_cache = _case(T, H, Hkv, d, Nb, S, P, dtype, seed)
    want_q, want_k = _hf_rotate(config, q_THd, k_THd, positions_T)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    _naive_store(want_k, v_THd, want_kc, want_vc, slots_T)

    table_Pd = rotary.cos_sin_cache(torch.device(DEV), dtype)
    q_rot = kernels.rope_store_kv(q_THd, k_THd, v_THd, positions_T, table_Pd, k_cache, v_cache, slots_T)
    assert q_rot.is_contiguous() and q_rot.dtype == dtype
    assert _same(q_rot, want_q), (q_rot.float() - want_q.float()).abs().max()
    assert _same(k_cache, want_kc), (k_cache.float() - want_kc.float()).nan_to_num().abs().max()
    assert _same(v_cache, want_vc)
    # the PyTorch reference of the same signature agrees too
    ref_kc, ref_vc = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    assert _same(rope_store_kv_ref(q_THd, k_THd, v_THd, positions_T, table_Pd, ref_kc, ref_vc, slots_T), want_q)
    assert _same(ref_kc, want_kc) and _same(ref_vc, want_vc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("H,Hkv,d", [(4, 2, 16), (4, 1, 64), (2, 2, 128)])
def test_rope_store_kv_matches_transformers(H, Hkv, d, dtype):
    _check_against_hf(7, H, Hkv, d, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_store_kv_yarn_scaling(dtype):
    """A rope type with attention_scaling != 1 (yarn): the scale is in the table as in transformers' cos/sin."""
    _check_against_hf(6, 4, 2, 16, dtype, rope=YARN)


def test_cos_sin_cache_rows_and_reuse():
    config = _hf_config(2, 1, 16, 48)
    rotary = RotaryEmbedding(config, 16)
    table = rotary.cos_sin_cache(torch.device("cpu"), torch.bfloat16)
    assert table.shape == (48, 16) and table.dtype == torch.bfloat16
    cos_Pd, sin_Pd = rotary.cos_sin(torch.arange(48), torch.bfloat16)
    assert torch.equal(table, torch.cat([cos_Pd[:, :8], sin_Pd[:, :8]], dim=1))
    assert torch.equal(cos_Pd[:, :8], cos_Pd[:, 8:])  # the halves repeat: the table keeps one
    assert rotary.cos_sin_cache(torch.device("cpu"), torch.bfloat16) is table  # built once
    assert RotaryEmbedding(config, 16, max_positions=8).cos_sin_cache("cpu", torch.float32).shape == (8, 16)


def test_rope_store_kv_refuses_bad_input():
    q_THd, k_THd, v_THd, positions_T, slots_T, k_cache, v_cache = _case(3, 2, 1, 16, 2, 4, 16, torch.bfloat16)
    table = RotaryEmbedding(_hf_config(2, 1, 16, 16), 16).cos_sin_cache(torch.device(DEV), torch.bfloat16)
    with pytest.raises(ValueError, match="cos_sin is torch.float32"):
        kernels.rope_store_kv(q_THd, k_THd, v_THd, positions_T, table.float(), k_cache, v_cache, slots_T)
    with pytest.raises(ValueError, match="do not fit caches"):
        kernels.rope_store_kv(q_THd, k_THd, v_THd, positions_T, table, k_cache[:, :, :, :8], v_cache, slots_T)
    # a position past the table reads nothing out of bounds: cos = sin = 0 there
    far_T = torch.tensor([0, 16, 10 ** 6], device=DEV)
    q_rot = kernels.rope_store_kv(q_THd, k_THd, v_THd, far_T, table, k_cache, v_cache, slots_T)
    assert torch.equal(q_rot[1:], torch.zeros_like(q_rot[1:])) and not torch.equal(q_rot[0], torch.zeros_like(q_rot[0]))
    with pytest.raises(ValueError, match="must be \\[3\\]"):
        kernels.rope_store_kv(q_THd, k_THd, v_THd, positions_T[:2], table, k_cache, v_cache, slots_T)


# ---- GPU: Qwen3-30B-A3B's attention shapes against today's torch path, and inside a CUDA graph ----

@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_store_kv_qwen3_shapes_gpu(dtype):
    """H=32, Hkv=4, d=128, positions up to 40959: the kernel against RotaryEmbedding.forward + store_kv
    (the unfused path) and transformers, bit for bit."""
    T, H, Hkv, d, P = 300, 32, 4, 128, 40960
    config = _hf_config(H, Hkv, d, P)
    rotary = RotaryEmbedding(config, d).cuda()
    q_THd, k_THd, v_THd, positions_T, slots_T, k_cache, v_cache = _case(T, H, Hkv, d, 100, 16, P, dtype)
    want_q, want_k = rotary(positions_T, q_THd, k_THd)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    store_kv(want_k, v_THd, want_kc, want_vc, slots_T)
    got = kernels.rope_store_kv(q_THd, k_THd, v_THd, positions_T, rotary.cos_sin_cache(q_THd.device, dtype),
                                k_cache, v_cache, slots_T)
    assert _same(got, want_q) and _same(k_cache, want_kc) and _same(v_cache, want_vc)
    hf_q, _ = _hf_rotate(config, q_THd, k_THd, positions_T)
    assert _same(got, hf_q)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_rope_store_kv_in_a_cuda_graph_gpu():
    """Captured once, replayed on new inputs copied into the static buffers: the eager result."""
    T, H, Hkv, d, P = 16, 32, 4, 128, 4096
    rotary = RotaryEmbedding(_hf_config(H, Hkv, d, P), d).cuda()
    table = rotary.cos_sin_cache(torch.device("cuda"), torch.bfloat16)  # built eagerly, before capture
    static = _case(T, H, Hkv, d, 8, 16, P, torch.bfloat16, seed=1)
    kernels.rope_store_kv(*static[:4], table, static[5], static[6], static[4])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.rope_store_kv(*static[:4], table, static[5], static[6], static[4])
    fresh = _case(T, H, Hkv, d, 8, 16, P, torch.bfloat16, seed=2)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    want_kc, want_vc = fresh[5].clone(), fresh[6].clone()
    want = kernels.rope_store_kv(*fresh[:4], table, want_kc, want_vc, fresh[4])
    assert _same(out, want) and _same(static[5], want_kc) and _same(static[6], want_vc)


# ---- in the engine: the fused path changes no bit of the output ----

ENGINE_PROMPTS = [[7, 19, 33, 41, 58, 62, 77, 80, 91, 15, 23], [11, 12, 13], list(range(40, 53))]


def _engine_generate(family, device, backend, fused=True, monkeypatch=None, dtype="bfloat16"):
    """Greedy tokens and top-3 logprobs of every step, chunked prefill; with fused=False the triton
    backend runs as before the fusion (RotaryEmbedding.forward, then store_kv + the paged kernel)."""
    from engine_fixtures import checkpoint
    from moe_infer import LLM, SamplingParams
    from moe_infer.layers.paged_attention import ROPE_FUSED_BACKENDS
    from moe_infer.plugins import load_plugins

    load_plugins()  # registers "triton" (the engine would, inside LLM)
    fused = fused and backend in ROPE_FUSED_BACKENDS
    if not fused and monkeypatch is not None:
        monkeypatch.delitem(ROPE_FUSED_BACKENDS._entries, backend)
    llm = LLM(model=checkpoint(family), dtype=dtype, device=device, block_size=4, attention_backend=backend,
              num_kv_blocks=32, max_num_batched_tokens=8, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert all((model.layers[i].self_attn._rope_fused is not None) == fused for i in model.local_layers)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in ENGINE_PROMPTS], params, use_tqdm=False)
    assert llm.engine.scheduler.num_chunked_prefills > 0
    assert bool(model.rotary._tables) == fused  # the cos/sin table exists only where the fused kernel ran
    if monkeypatch is not None:
        monkeypatch.undo()
    return [(o.outputs[0].token_ids, [sorted(e.items()) for e in o.outputs[0].logprobs]) for o in outs]


def _logprob_values(result):
    return [(tokens, [[(i, lp.logprob, lp.rank) for i, lp in step] for step in steps]) for tokens, steps in result]


@pytest.mark.timeout(400)  # the interpreter runs every attention call of the engine
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])  # per-head q/k norm; whole-projection norm + clip_qkv
def test_fused_engine_equals_unfused_interpreter(family, monkeypatch):
    """bf16: the fused path and the unfused one give the same logprobs, bit for bit."""
    if DEV != "cpu":
        pytest.skip("the GPU variant below runs it on CUDA")
    fused = _engine_generate(family, "cpu", "triton")
    assert _logprob_values(fused) == _logprob_values(_engine_generate(family, "cpu", "triton", False, monkeypatch))


@pytest.mark.timeout(400)
def test_fused_engine_tokens_equal_torch_backend_interpreter():
    """float32: the fused triton path's greedy tokens are the torch reference backend's. (bf16 tokens of the two
    backends may part after a near tie: their attention kernels round differently, before and after the fusion.
    qwen3_moe's float32 tokens are checked against transformers in test_engine_parity.py.)"""
    if DEV != "cpu":
        pytest.skip("test_engine_parity.py's CUDA triton tests run the fused path against transformers")
    fused = _engine_generate("olmoe", "cpu", "triton", dtype="float32")
    assert [t for t, _ in fused] == [t for t, _ in _engine_generate("olmoe", "cpu", "torch", dtype="float32")]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_fused_engine_equals_unfused_gpu(family, monkeypatch):
    """bf16 on CUDA (decode steps in CUDA graphs): the same logprobs, bit for bit, fused or not."""
    fused = _engine_generate(family, "cuda", "triton")
    assert _logprob_values(fused) == _logprob_values(_engine_generate(family, "cuda", "triton", False, monkeypatch))
