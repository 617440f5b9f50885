"""The fused rotary + K/V-write kernel (`moe_infer.kernels.rope_kv`) against transformers'
`apply_rotary_pos_emb` with cos/sin from transformers' own rotary class and a naive per-slot loop
writing the cache: bit for bit, in bfloat16, float16 and float32 (interpreter on CPU, CUDA with -m gpu).
With the q/k RMSNorm folded in, against transformers' Qwen3-MoE (per head) and OLMoE (whole projection)
norm modules first: bit for bit where the sum of squares is exact in any order, else within an ulp of the
normed values (the float32 sum's order), as tests/test_rms_norm.py.
In the engine, the fused path against the unfused one (same logprobs) and the torch backend.

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


def _case(T, H, Hkv, d, Nb, S, P, dtype, seed=0, exact_squares=False):
    """Strided q, k, v (views of one fused projection), positions with 0 and P - 1, distinct slots with
    padding rows (-1), caches full of NaN (a slot never written stays NaN). exact_squares: values j/8 with
    |j| <= 24, whose squares and every partial sum of them (under 2^24 / 64) are exact in float32, so a
    norm's sum of squares is the same in any order."""
    g = torch.Generator().manual_seed(seed)
    if exact_squares:
        qkv_TX = (torch.randint(-24, 25, (T, (H + 2 * Hkv) * d), generator=g) / 8).to(dtype).to(DEV)
    else:
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


# ---- the q/k RMSNorm folded in: against transformers' norm modules, then its rotary ----

def _hf_qk_norms(mode, H, Hkv, d, dtype, eps=1e-6):
    """transformers' q and k norms with random weights (q's differ from k's) -> (q weight, k weight,
    norm of q [T, H, d], norm of k [T, Hkv, d]): Qwen3-MoE's per head ("head"), OLMoE's over the whole
    [T, heads * d] projection ("proj")."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    g = torch.Generator().manual_seed(H * 100 + Hkv * 10 + d)
    norms = []
    for heads in (H, Hkv):
        norm = Qwen3MoeRMSNorm(d, eps=eps) if mode == "head" else OlmoeRMSNorm(heads * d, eps=eps)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
        norms.append(norm.to(DEV, dtype))

    def apply(norm, x_THd):
        T, heads, _ = x_THd.shape
        return norm(x_THd) if mode == "head" else norm(x_THd.reshape(T, heads * d)).view(T, heads, d)

    q_norm, k_norm = norms
    return q_norm.weight.data, k_norm.weight.data, lambda x: apply(q_norm, x), lambda x: apply(k_norm, x)


def _assert_ulp_close(out, want):
    """As tests/test_rms_norm.py's: equal but for the norm's float32 sum of squares reduced in another order,
    which moves a normed value by one ulp of the dtype where it sits on a rounding boundary (16-bit: rarely), or
    by float32 ulps (float32). Through the rotation that is a few ulps of the head's largest magnitude at most;
    NaN (never-written cache slots) in the same places."""
    assert out.shape == want.shape and out.dtype == want.dtype
    assert torch.equal(out.isnan(), want.isnan())
    o, w = out.float().nan_to_num(), want.float().nan_to_num()
    # [..., 1] per head: float32 as test_rms_norm's rtol (CUDA's rsqrt is approximate), 16-bit a few ulps
    rtol = 1e-6 if out.dtype == torch.float32 else 6 * torch.finfo(out.dtype).eps
    bound = rtol * w.abs().amax(-1, keepdim=True)
    diff = (o - w).abs()
    assert (diff <= bound).all(), (diff - bound).max()
    if out.dtype != torch.float32:
        assert (o == w).float().mean() >= 0.99, (o != w).float().mean()


def _check_norm_against_hf(T, H, Hkv, d, dtype, mode, exact_squares=False, Nb=6, S=4, P=64, seed=0):
    """The kernel with the q/k norm against transformers' norm modules, its rotary and the naive cache write;
    the PyTorch reference with the same arguments too. Bit for bit where the sum of squares is exact in any
    order (exact_squares, the interpreter: its rsqrt and torch's CPU one are both 1 / correctly rounded sqrt)."""
    config = _hf_config(H, Hkv, d, P)
    rotary = RotaryEmbedding(config, d).to(DEV)
    q_THd, k_THd, v_THd, positions_T, slots_T, k_cache, v_cache = _case(T, H, Hkv, d, Nb, S, P, dtype, seed,
                                                                       exact_squares)
    q_w, k_w, hf_q_norm, hf_k_norm = _hf_qk_norms(mode, H, Hkv, d, dtype)
    want_q, want_k = _hf_rotate(config, hf_q_norm(q_THd), hf_k_norm(k_THd), positions_T)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    _naive_store(want_k, v_THd, want_kc, want_vc, slots_T)

    table_Pd = rotary.cos_sin_cache(torch.device(DEV), dtype)
    norm = dict(q_norm_weight=q_w, k_norm_weight=k_w, norm_eps=1e-6, norm_mode=mode)
    q_rot = kernels.rope_store_kv(q_THd, k_THd, v_THd, positions_T, table_Pd, k_cache, v_cache, slots_T, **norm)
    assert q_rot.is_contiguous() and q_rot.dtype == dtype
    assert _same(v_cache, want_vc)  # v is not normed
    if exact_squares and DEV == "cpu":
        assert _same(q_rot, want_q), (q_rot.float() - want_q.float()).abs().max()
        assert _same(k_cache, want_kc), (k_cache.float() - want_kc.float()).nan_to_num().abs().max()
    else:
        _assert_ulp_close(q_rot, want_q)
        _assert_ulp_close(k_cache, want_kc)
    # the PyTorch reference (rms_norm_torch: transformers' ops) agrees bit for bit
    ref_kc, ref_vc = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    assert _same(rope_store_kv_ref(q_THd, k_THd, v_THd, positions_T, table_Pd, ref_kc, ref_vc, slots_T, **norm),
                 want_q)
    assert _same(ref_kc, want_kc) and _same(ref_vc, want_vc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("H,Hkv,d", [(4, 2, 16), (6, 2, 64), (3, 1, 24)])  # non-power-of-two heads and halves
@pytest.mark.parametrize("mode", ["head", "proj"])
def test_rope_store_kv_norm_matches_transformers(mode, H, Hkv, d, dtype):
    _check_norm_against_hf(7, H, Hkv, d, dtype, mode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["head", "proj"])
def test_rope_store_kv_norm_bit_exact_on_exact_sums(mode, dtype):
    """Where the sum of squares has one value in any order, nothing else may differ: bit for bit."""
    _check_norm_against_hf(9, 6, 2, 64, dtype, mode, exact_squares=True, seed=3)


def test_rope_store_kv_norm_refuses_bad_input():
    q_THd, k_THd, v_THd, positions_T, slots_T, k_cache, v_cache = _case(3, 2, 1, 16, 2, 4, 16, torch.bfloat16)
    table = RotaryEmbedding(_hf_config(2, 1, 16, 16), 16).cos_sin_cache(torch.device(DEV), torch.bfloat16)
    args = (q_THd, k_THd, v_THd, positions_T, table, k_cache, v_cache, slots_T)
    w16 = torch.ones(16, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="norm_mode must be one of"):
        kernels.rope_store_kv(*args, q_norm_weight=w16, k_norm_weight=w16, norm_mode="rms")
    with pytest.raises(ValueError, match="needs k_norm_weight"):
        kernels.rope_store_kv(*args, q_norm_weight=w16, norm_mode="head")
    with pytest.raises(ValueError, match=r"must be a contiguous \[32\]"):  # "proj": q's weight spans H * d
        kernels.rope_store_kv(*args, q_norm_weight=w16, k_norm_weight=w16, norm_mode="proj")
    with pytest.raises(ValueError, match="must be a contiguous"):
        kernels.rope_store_kv(*args, q_norm_weight=w16.float(), k_norm_weight=w16, norm_mode="head")
    with pytest.raises(ValueError, match="norm_mode must be"):
        rope_store_kv_ref(*args, q_norm_weight=w16, k_norm_weight=w16, norm_mode="rms")


# ---- GPU: Qwen3-30B-A3B's attention shapes against today's torch path, and inside a CUDA graph ----

@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["none", "head", "proj"])
def test_rope_store_kv_qwen3_shapes_gpu(mode, dtype):
    """H=32, Hkv=4, d=128, positions up to 40959: the kernel against the unfused path (transformers' q/k norm
    modules, RotaryEmbedding.forward, store_kv) and transformers' rotary; bit for bit without a norm."""
    T, H, Hkv, d, P = 300, 32, 4, 128, 40960
    config = _hf_config(H, Hkv, d, P)
    rotary = RotaryEmbedding(config, d).cuda()
    q_THd, k_THd, v_THd, positions_T, slots_T, k_cache, v_cache = _case(T, H, Hkv, d, 100, 16, P, dtype)
    norm, q_in, k_in = {}, q_THd, k_THd
    if mode != "none":
        q_w, k_w, hf_q_norm, hf_k_norm = _hf_qk_norms(mode, H, Hkv, d, dtype)
        norm = dict(q_norm_weight=q_w, k_norm_weight=k_w, norm_eps=1e-6, norm_mode=mode)
        q_in, k_in = hf_q_norm(q_THd), hf_k_norm(k_THd)
    want_q, want_k = rotary(positions_T, q_in, k_in)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    store_kv(want_k, v_THd, want_kc, want_vc, slots_T)
    got = kernels.rope_store_kv(q_THd, k_THd, v_THd, positions_T, rotary.cos_sin_cache(q_THd.device, dtype),
                                k_cache, v_cache, slots_T, **norm)
    assert _same(v_cache, want_vc)
    hf_q, _ = _hf_rotate(config, q_in, k_in, positions_T)
    if mode == "none":
        assert _same(got, want_q) and _same(k_cache, want_kc) and _same(got, hf_q)
    else:
        _assert_ulp_close(got, want_q)
        _assert_ulp_close(k_cache, want_kc)
        _assert_ulp_close(got, hf_q)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["none", "head"])
def test_rope_store_kv_in_a_cuda_graph_gpu(mode):
    """Captured once, replayed on new inputs copied into the static buffers: the eager result."""
    T, H, Hkv, d, P = 16, 32, 4, 128, 4096
    rotary = RotaryEmbedding(_hf_config(H, Hkv, d, P), d).cuda()
    table = rotary.cos_sin_cache(torch.device("cuda"), torch.bfloat16)  # built eagerly, before capture
    norm = {}
    if mode != "none":
        q_w, k_w, _, _ = _hf_qk_norms(mode, H, Hkv, d, torch.bfloat16)
        norm = dict(q_norm_weight=q_w, k_norm_weight=k_w, norm_eps=1e-6, norm_mode=mode)
    static = _case(T, H, Hkv, d, 8, 16, P, torch.bfloat16, seed=1)
    kernels.rope_store_kv(*static[:4], table, static[5], static[6], static[4], **norm)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.rope_store_kv(*static[:4], table, static[5], static[6], static[4], **norm)
    fresh = _case(T, H, Hkv, d, 8, 16, P, torch.bfloat16, seed=2)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    want_kc, want_vc = fresh[5].clone(), fresh[6].clone()
    want = kernels.rope_store_kv(*fresh[:4], table, want_kc, want_vc, fresh[4], **norm)
    assert _same(out, want) and _same(static[5], want_kc) and _same(static[6], want_vc)


# ---- in the engine: the fused path changes no bit of the output (but a rare ulp of a fused norm) ----

ENGINE_PROMPTS = [[7, 19, 33, 41, 58, 62, 77, 80, 91, 15, 23], [11, 12, 13], list(range(40, 53))]
# (family, checkpoint overrides, the q/k norm the fused kernel applies)
ENGINE_CASES = [
    pytest.param("qwen3_moe", {}, "head", id="qwen3_moe-head_norm"),
    pytest.param("olmoe", {"clip_qkv": None}, "proj", id="olmoe-proj_norm"),
    pytest.param("olmoe", {}, "none", id="olmoe-clip_qkv"),  # clamped after the norm: the modules norm
]


def _engine_generate(family, device, backend, fused=True, monkeypatch=None, dtype="bfloat16", overrides=None,
                     fused_norm="none"):
    """Greedy tokens and top-3 logprobs of every step, chunked prefill; with fused=False the triton
    backend runs as before the fusion (RMSNorm modules, RotaryEmbedding.forward, then store_kv + the paged
    kernel). fused_norm: the q/k norm the fused kernel must apply."""
    from engine_fixtures import checkpoint
    from moe_infer import LLM, SamplingParams
    from moe_infer.layers.paged_attention import ROPE_FUSED_BACKENDS
    from moe_infer.plugins import load_plugins

    load_plugins()  # registers "triton" (the engine would, inside LLM)
    fused = fused and backend in ROPE_FUSED_BACKENDS
    if not fused and monkeypatch is not None:
        monkeypatch.delitem(ROPE_FUSED_BACKENDS._entries, backend)
    llm = LLM(model=checkpoint(family, **(overrides or {})), dtype=dtype, device=device, block_size=4,
              attention_backend=backend, num_kv_blocks=32, max_num_batched_tokens=8, enable_prefix_caching=False)
    model = llm.engine.runner.model
    layers = [model.layers[i].self_attn for i in model.local_layers]
    assert all((attn._rope_fused is not None) == fused for attn in layers)
    assert all(attn.fused_norm == (fused_norm if fused else "none") for attn in layers)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in ENGINE_PROMPTS], params, use_tqdm=False)
    assert llm.engine.scheduler.num_chunked_prefills > 0
    assert bool(model.rotary._tables) == fused  # the cos/sin table exists only where the fused kernel ran
    if monkeypatch is not None:
        monkeypatch.undo()
    return [(o.outputs[0].token_ids, [sorted(e.items()) for e in o.outputs[0].logprobs]) for o in outs]


def _logprob_values(result):
    return [(tokens, [[(i, lp.logprob, lp.rank) for i, lp in step] for step in steps]) for tokens, steps in result]


def _assert_same_generation(fused, unfused, fused_norm):
    """Bit for bit without a fused norm. With one, its float32 sum of squares is reduced in another order
    than the RMSNorm modules' (torch's, or the RMSNorm kernel's on CUDA), which may move a normed q/k value
    by one bf16 ulp (rarely: the interpreter runs here give the same bits): then the same greedy tokens, and
    the logprobs of the top-3 ids that both runs list within 0.05 (a bf16 ulp of a logit below 12.8)."""
    if fused_norm == "none" or _logprob_values(fused) == _logprob_values(unfused):
        assert _logprob_values(fused) == _logprob_values(unfused)
        return
    assert [tokens for tokens, _ in fused] == [tokens for tokens, _ in unfused]
    for (_, steps_f), (_, steps_u) in zip(fused, unfused):
        for step_f, step_u in zip(steps_f, steps_u):
            unfused_lps = dict(step_u)
            for i, lp in step_f:
                if i in unfused_lps:
                    assert abs(lp.logprob - unfused_lps[i].logprob) <= 0.05, (i, lp, unfused_lps[i])


@pytest.mark.timeout(400)  # the interpreter runs every attention call of the engine
@pytest.mark.parametrize("family,overrides,fused_norm", ENGINE_CASES)
def test_fused_engine_equals_unfused_interpreter(family, overrides, fused_norm, monkeypatch):
    """bf16: the fused path and the unfused one give the same logprobs (bit for bit without a fused norm)."""
    if DEV != "cpu":
        pytest.skip("the GPU variant below runs it on CUDA")
    fused = _engine_generate(family, "cpu", "triton", overrides=overrides, fused_norm=fused_norm)
    unfused = _engine_generate(family, "cpu", "triton", False, monkeypatch, overrides=overrides)
    _assert_same_generation(fused, unfused, fused_norm)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("overrides,fused_norm", [({}, "none"), ({"clip_qkv": None}, "proj")])
def test_fused_engine_tokens_equal_torch_backend_interpreter(overrides, fused_norm):
    """float32: the fused triton path's greedy tokens are the torch reference backend's. (bf16 tokens of the two
    backends may part after a near tie: their attention kernels round differently, before and after the fusion.
    qwen3_moe's float32 tokens are checked against transformers in test_engine_parity.py.)"""
    if DEV != "cpu":
        pytest.skip("test_engine_parity.py's CUDA triton tests run the fused path against transformers")
    fused = _engine_generate("olmoe", "cpu", "triton", dtype="float32", overrides=overrides, fused_norm=fused_norm)
    want = _engine_generate("olmoe", "cpu", "torch", dtype="float32", overrides=overrides)
    assert [t for t, _ in fused] == [t for t, _ in want]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,overrides,fused_norm", ENGINE_CASES)
def test_fused_engine_equals_unfused_gpu(family, overrides, fused_norm, monkeypatch):
    """bf16 on CUDA (decode steps in CUDA graphs): the same logprobs, fused or not (bit for bit without a
    fused norm; the unfused norm is the RMSNorm kernel there)."""
    fused = _engine_generate(family, "cuda", "triton", overrides=overrides, fused_norm=fused_norm)
    unfused = _engine_generate(family, "cuda", "triton", False, monkeypatch, overrides=overrides)
    _assert_same_generation(fused, unfused, fused_norm)


def test_attention_fuses_the_norm_where_it_can():
    """The fused kernel takes the q/k norm per head, and over the whole projection at tp = 1 without clip_qkv;
    under tp > 1 (ShardedRMSNorm), with clip_qkv, or with a backend without the fused kernel, the modules norm."""
    from dataclasses import replace

    from engine_fixtures import checkpoint
    from moe_infer.layers.attention import Attention
    from moe_infer.layers.tensor_parallel import SINGLE, ShardGroup
    from moe_infer.models.arch import load_arch
    from moe_infer.plugins import load_plugins

    load_plugins()
    qwen3, olmoe = load_arch(checkpoint("qwen3_moe"))[0], load_arch(checkpoint("olmoe"))[0]
    assert (qwen3.qk_norm, olmoe.qk_norm, olmoe.clip_qkv) == ("head", "proj", 2.5)
    tp2 = ShardGroup(object(), 0, 2)  # no collective runs here

    def fused_norm(arch, backend="triton", tp=SINGLE):
        return Attention(arch, 0, None, torch.float32, backend, tp).fused_norm

    assert fused_norm(qwen3) == "head" and fused_norm(qwen3, tp=tp2) == "head"
    assert fused_norm(replace(olmoe, clip_qkv=None)) == "proj"
    assert fused_norm(replace(olmoe, clip_qkv=None), tp=tp2) == "none"
    assert fused_norm(olmoe) == "none"
    assert fused_norm(replace(qwen3, qk_norm="none")) == "none"
    assert fused_norm(qwen3, backend="torch") == "none"
