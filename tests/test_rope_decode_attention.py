"""The one-kernel decode attention (`moe_infer.kernels.rope_decode_attention`: q/k norm, rotary, K/V write and
paged attention) against the PyTorch references run in turn (`rope_store_kv_ref`, then `paged_attention_ref`)
and a dense softmax over each sequence's keys; its cache writes bit for bit against the references' and against
the two kernels it replaces (`rope_store_kv` + `paged_attention_triton`). Interpreter on CPU, CUDA with -m gpu.
The engine with it: tests/test_rope_kv_engine.py (decode steps of the fused path).

Legend: B sequences (one token each), H query heads, Hkv KV heads, d head_dim, Nb cache blocks, S block size.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from moe_infer.layers.paged_attention import paged_attention_ref, store_kv
from moe_infer.layers.rotary import RotaryEmbedding, rope_store_kv_ref

pytestmark = pytest.mark.timeout(240)

kernels = pytest.importorskip("moe_infer.kernels.rope_decode_attention")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1", allow_module_level=True)


def _case(contexts, H, Hkv, d, S, dtype, norm, seed=0, pad_rows=1, Nb=48):
    """A decode step: sequence b has contexts[b] cached keys (random, written by store_kv) and one new token;
    pad_rows padding rows at the end (slot -1, one key of seq_len 1 as the decode graphs pad). Caches hold
    NaN where nothing was written. norm "head": values j/8 (|j| <= 24) whose squares sum exactly in any order,
    so the kernel's norm and the reference's give the same bits."""
    g = torch.Generator().manual_seed(seed)
    B = len(contexts)
    T = B + pad_rows
    if norm == "head":
        qkv = (torch.randint(-24, 25, (T, (H + 2 * Hkv) * d), generator=g) / 8).to(dtype)
    else:
        qkv = (2 * torch.randn(T, (H + 2 * Hkv) * d, generator=g)).to(dtype)
    q, k, v = qkv.to(DEV).split([H * d, Hkv * d, Hkv * d], dim=-1)
    q_THd, k_THd, v_THd = q.view(T, H, d), k.view(T, Hkv, d), v.view(T, Hkv, d)  # strided views, as the engine's
    k_cache = torch.full((Nb, S, Hkv, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = k_cache.clone()
    free = torch.randperm(Nb, generator=g).tolist()
    tables, slots = [], []
    for c in contexts:
        blocks = [free.pop() for _ in range(-(-(c + 1) // S))]
        tables.append(blocks)
        all_slots = torch.tensor([blocks[j // S] * S + j % S for j in range(c + 1)], device=DEV)
        store_kv((torch.randn(c, Hkv, d, generator=g)).to(dtype).to(DEV), torch.randn(c, Hkv, d, generator=g)
                 .to(dtype).to(DEV), k_cache, v_cache, all_slots[:c])
        slots.append(int(all_slots[c]))
    tables += [[free.pop()] for _ in range(pad_rows)]
    M = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (M - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(list(c + 1 for c in contexts) + [1] * pad_rows, dtype=torch.int32, device=DEV)
    positions = torch.tensor(list(contexts) + [0] * pad_rows, device=DEV)
    slot_mapping = torch.tensor(slots + [-1] * pad_rows, device=DEV)
    query_start = torch.arange(T + 1, dtype=torch.int32, device=DEV)
    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                             max_position_embeddings=max(contexts) + 8)
    cos_sin = RotaryEmbedding(config, d).to(DEV).cos_sin_cache(torch.device(DEV), dtype)
    norm_kw = {}
    if norm == "head":
        w = (1 + torch.randint(-4, 5, (2, d), generator=g) / 8).to(dtype).to(DEV)
        norm_kw = dict(q_norm_weight=w[0], k_norm_weight=w[1], norm_eps=1e-6, norm_mode="head")
    return dict(q=q_THd, k=k_THd, v=v_THd, positions=positions, cos_sin=cos_sin, k_cache=k_cache, v_cache=v_cache,
                slots=slot_mapping, tables=block_tables, seq_lens=seq_lens, query_start=query_start,
                max_seq_len=max(contexts) + 1, norm_kw=norm_kw, B=B)


def _fused(c, window=None, splits=None, block_n=None, **sinks):
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    out = kernels.rope_decode_attention(
        c["q"], c["k"], c["v"], c["positions"], c["cos_sin"], kc, vc, c["slots"], c["tables"], c["seq_lens"],
        c["query_start"], c["q"].shape[-1] ** -0.5, c["max_seq_len"], window, splits=splits, block_n=block_n,
        **c["norm_kw"], **sinks)
    return out, kc, vc


def _references(c, window=None, **sinks):
    """rope_store_kv_ref, then paged_attention_ref (float32 math), each on its own copy of the caches."""
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    q = rope_store_kv_ref(c["q"], c["k"], c["v"], c["positions"], c["cos_sin"], kc, vc, c["slots"], **c["norm_kw"])
    out = paged_attention_ref(q, kc, vc, c["tables"], c["seq_lens"], c["query_start"], c["positions"],
                              c["q"].shape[-1] ** -0.5, 1, c["max_seq_len"], window, **sinks)
    return out, kc, vc, q


def _dense(q_Hd, k_LHd, v_LHd, scale, window):
    """One query (the last position) over keys 0..L-1 by a plain softmax (GQA by repeating K/V)."""
    H, Hkv = q_Hd.shape[0], k_LHd.shape[1]
    k = k_LHd.float().repeat_interleave(H // Hkv, dim=1)
    v = v_LHd.float().repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("hd,khd->hk", q_Hd.float(), k) * scale
    if window is not None:
        s[:, : max(0, k.shape[0] - window)] = float("-inf")
    return torch.einsum("hk,khd->hd", torch.softmax(s, -1), v)


def _same(a, b):
    """Bit-identical, NaN (never-written slots) included."""
    return torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.view(torch.int16 if b.element_size() == 2 else torch.int32))


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", ["none", "head"])
@pytest.mark.parametrize("H,Hkv,S,window", [(4, 2, 4, None), (8, 1, 5, None), (4, 4, 3, 6)])
def test_matches_the_references(dtype, norm, H, Hkv, S, window):
    c = _case([5, 0, 11, 22], H, Hkv, 16, S, dtype, norm, seed=H + S)
    out, kc, vc = _fused(c, window)
    want, kc_ref, vc_ref, q_ref = _references(c, window)
    assert _same(kc, kc_ref) and _same(vc, vc_ref)  # the new keys and values, bit for bit; nothing else written
    torch.testing.assert_close(out[:c["B"]].float(), want[:c["B"]].float(), **TOL[dtype])
    # and a plain softmax over the sequence's keys, read back from the reference's cache
    S_ = kc_ref.shape[1]
    for b in range(c["B"]):
        L = int(c["seq_lens"][b])
        blocks = c["tables"][b].long()
        idx = torch.arange(L, device=DEV)
        k_LHd, v_LHd = kc_ref[blocks[idx // S_], idx % S_], vc_ref[blocks[idx // S_], idx % S_]
        dense = _dense(q_ref[b], k_LHd, v_LHd, c["q"].shape[-1] ** -0.5, window)
        torch.testing.assert_close(out[b].float(), dense, **TOL[dtype])


@pytest.mark.parametrize("splits,block_n", [(1, 16), (2, 16), (4, 16), (4, 32), (2, 64)])
@pytest.mark.parametrize("window", [None, 20])
def test_splits_over_long_contexts(splits, block_n, window):
    """Contexts up to 90 keys in 16- to 64-key tiles: the new key falls in the first, a middle and the last split."""
    c = _case([40, 3, 89, 64], 8, 2, 16, 8, torch.float32, "head", seed=splits)
    out, kc, vc = _fused(c, window, splits=splits, block_n=block_n)
    want, kc_ref, vc_ref, _ = _references(c, window)
    assert _same(kc, kc_ref) and _same(vc, vc_ref)
    torch.testing.assert_close(out[:c["B"]], want[:c["B"]], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 20])
def test_sinks(splits, window):
    """GPT-OSS's attention sinks (a logit per head in the denominator; from below to above the scores), in one
    program's normalisation and in the split merge, against the reference (whose sinks tests/test_paged_attention.py
    checks against a dense softmax)."""
    c = _case([40, 3, 89, 64], 8, 2, 16, 8, torch.float32, "none", seed=splits + 7)
    sinks_H = torch.linspace(-6.0, 9.0, 8, device=DEV)[torch.tensor([3, 0, 7, 5, 1, 6, 2, 4])].contiguous()
    out, kc, vc = _fused(c, window, splits=splits, block_n=16, sinks_H=sinks_H)
    want, kc_ref, vc_ref, _ = _references(c, window, sinks_H=sinks_H)
    assert _same(kc, kc_ref) and _same(vc, vc_ref)
    torch.testing.assert_close(out[:c["B"]], want[:c["B"]], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("norm", ["none", "head"])
def test_equals_the_two_kernels_it_replaces(norm):
    """rope_store_kv + paged_attention_triton, bf16: the same cache bits and the same output bits (the norm's
    values sum exactly in any order)."""
    from moe_infer.kernels.paged_attention import paged_attention_triton
    from moe_infer.kernels.rope_kv import rope_store_kv

    c = _case([7, 30, 1], 8, 2, 16, 4, torch.bfloat16, norm, seed=3)
    out, kc, vc = _fused(c)
    kc2, vc2 = c["k_cache"].clone(), c["v_cache"].clone()
    q = rope_store_kv(c["q"], c["k"], c["v"], c["positions"], c["cos_sin"], kc2, vc2, c["slots"], **c["norm_kw"])
    want = paged_attention_triton(q, kc2, vc2, c["tables"], c["seq_lens"], c["query_start"], c["positions"],
                                  16 ** -0.5, 1, c["max_seq_len"])
    assert _same(kc, kc2) and _same(vc, vc2)
    assert _same(out[:c["B"]], want[:c["B"]])


def test_padding_rows_write_nothing():
    """Padding rows (slot -1) leave the caches as they were; a sequence without a token is skipped."""
    c = _case([6, 9], 4, 2, 16, 4, torch.float32, "none", pad_rows=3)
    _, kc, vc = _fused(c)
    _, kc_ref, vc_ref, _ = _references(c)
    assert _same(kc, kc_ref) and _same(vc, vc_ref)
    written = (~torch.isnan(kc).all(-1).all(-1)) & torch.isnan(c["k_cache"]).all(-1).all(-1)
    assert int(written.sum()) == 2  # the two real tokens' slots, nothing for the padding rows


def test_supports_and_bad_inputs(monkeypatch):
    assert kernels.supports(128, "head", 1) and kernels.supports(64, "none", 0)
    assert not kernels.supports(128, "head", 2)  # a prefill chunk in the step
    assert not kernels.supports(96, "none", 1) and not kernels.supports(8, "none", 1)
    assert not kernels.supports(128, "proj", 1)  # OLMoE's norm over all heads
    monkeypatch.setenv(kernels.ENV, "0")
    assert not kernels.supports(128, "head", 1)
    monkeypatch.delenv(kernels.ENV)
    c = _case([3], 4, 2, 16, 4, torch.float32, "none")
    with pytest.raises(ValueError, match="norm_mode"):
        kernels.rope_decode_attention(c["q"], c["k"], c["v"], c["positions"], c["cos_sin"], c["k_cache"],
                                      c["v_cache"], c["slots"], c["tables"], c["seq_lens"], c["query_start"], 0.25,
                                      c["max_seq_len"], norm_mode="proj")
    with pytest.raises(ValueError, match="head"):
        kernels.rope_decode_attention(c["q"], c["k"], c["v"], c["positions"], c["cos_sin"], c["k_cache"],
                                      c["v_cache"], c["slots"], c["tables"], c["seq_lens"], c["query_start"], 0.25,
                                      c["max_seq_len"], norm_mode="head")
    with pytest.raises(ValueError, match="do not fit"):
        kernels.rope_decode_attention(c["q"], c["k"][:, :1], c["v"], c["positions"], c["cos_sin"], c["k_cache"],
                                      c["v_cache"], c["slots"], c["tables"], c["seq_lens"], c["query_start"], 0.25,
                                      c["max_seq_len"])


@pytest.mark.gpu
@pytest.mark.parametrize("contexts", [[127, 300, 5, 2047], [1000]], ids=["batch4", "one-long"])
def test_model_shapes_gpu(contexts):
    """Qwen3-30B-A3B's heads (32 / 4, d 128, per-head norm), bf16, pages of 16, the split count the wrapper chooses:
    against the references and bit for bit on the caches."""
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    c = _case(contexts, 32, 4, 128, 16, torch.bfloat16, "head", Nb=400)
    out, kc, vc = _fused(c)
    want, kc_ref, vc_ref, _ = _references(c)
    assert _same(kc, kc_ref) and _same(vc, vc_ref)
    torch.testing.assert_close(out[:c["B"]].float(), want[:c["B"]].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.timeout(600)
def test_engine_decode_steps_take_it(monkeypatch):
    """Qwen3-MoE (per-head q/k norm, head_dim 16), bf16, chunked prefill: the decode steps run the one-kernel path (counted), and
    the generation equals the one with it turned off (rope_store_kv + paged attention: the same logprobs, within
    an ulp of a norm where its float32 sum's order differs, as tests/test_rope_kv_engine.py)."""
    from dataclasses import replace

    from test_rope_kv_engine import _assert_same_generation, _engine_generate

    from moe_infer.layers.paged_attention import ROPE_FUSED_BACKENDS
    from moe_infer.plugins import load_plugins

    load_plugins()
    entry = ROPE_FUSED_BACKENDS.get("triton")
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return entry.decode(*args, **kwargs)

    monkeypatch.setitem(ROPE_FUSED_BACKENDS._entries, "triton", replace(entry, decode=counted))
    qwen3 = {"head_dim": 16}  # the fixture's 24 is not a power of two: those layers keep the two kernels
    one_kernel = _engine_generate("qwen3_moe", DEV, "triton", overrides=qwen3, fused_norm="head")
    assert calls  # decode steps (each layer) went through it
    calls.clear()
    monkeypatch.setenv(kernels.ENV, "0")
    two_kernels = _engine_generate("qwen3_moe", DEV, "triton", overrides=qwen3, fused_norm="head")
    assert not calls
    _assert_same_generation(one_kernel, two_kernels, "head")
