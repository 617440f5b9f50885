"""The fused rotary + K/V-write kernel (`moe_infer.kernels.rope_kv`) against transformers'
`apply_rotary_pos_emb` with cos/sin from transformers' own rotary class and a naive per-slot loop
writing the cache: bit for bit, in bfloat16, float16 and float32 (interpreter on CPU, CUDA with -m gpu).
With the q/k RMSNorm folded in, against transformers' Qwen3-MoE (per head) and OLMoE (whole projection)
norm modules first: bit for bit where the sum of squares is exact in any order, else within an ulp of the
normed values (the float32 sum's order), as tests/test_rms_norm.py.
The engine with the fused path: tests/test_rope_kv_engine.py.

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
