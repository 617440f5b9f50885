"""The paged-attention reference against dense causal attention computed sequence by sequence."""
import pytest
import torch

from moe_infer.layers.paged_attention import (
    ATTENTION_BACKENDS, paged_attention_ref, paged_attention_sdpa, resolve_attention_backend, store_kv,
)


def _dense(q_LHd, k_LHd, v_LHd, start, scale, window):
    """Queries at positions start..start+Lq-1 over keys 0..L-1 (GQA by repeating K/V)."""
    H, Hkv = q_LHd.shape[1], k_LHd.shape[1]
    k = k_LHd.repeat_interleave(H // Hkv, dim=1)
    v = v_LHd.repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q_LHd, k) * scale
    qpos = torch.arange(start, start + q_LHd.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= qpos - kpos < window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


MIXED, DECODE, PREFILL = [1, 7, 2, 4], [1, 1, 1, 1], [3, 7, 2, 4]  # this step's tokens per sequence


@pytest.mark.parametrize("H,Hkv,S,window,new", [
    (4, 2, 4, None, MIXED), (6, 6, 3, None, MIXED), (8, 1, 5, 4, MIXED), (4, 2, 16, None, MIXED),
    (4, 2, 4, None, DECODE), (8, 1, 5, 4, DECODE), (4, 2, 4, None, PREFILL), (8, 2, 3, 3, PREFILL),
])
@pytest.mark.parametrize("attend", [paged_attention_ref, paged_attention_sdpa])
def test_matches_dense(H, Hkv, S, window, new, attend):
    torch.manual_seed(H * 10 + S)
    d, Nb = 8, 40
    cached = [5, 0, 11, 3]  # tokens already in the cache per sequence
    k_cache = torch.full((Nb, S, Hkv, d), float("nan"))
    v_cache = torch.full((Nb, S, Hkv, d), float("nan"))
    free = torch.randperm(Nb).tolist()
    tables, ks, vs, qs, slots, pos = [], [], [], [], [], []
    for c, n in zip(cached, new):
        L = c + n
        blocks = [free.pop() for _ in range(-(-L // S))]
        tables.append(blocks)
        k, v = torch.randn(L, Hkv, d), torch.randn(L, Hkv, d)
        ks.append(k), vs.append(v), qs.append(torch.randn(n, H, d))
        all_slots = torch.tensor([blocks[j // S] * S + j % S for j in range(L)])
        store_kv(k[:c], v[:c], k_cache, v_cache, all_slots[:c])  # an earlier step's tokens
        slots.append(all_slots[c:])
        pos.append(torch.arange(c, L))
    M = max(len(t) for t in tables)
    q_THd = torch.cat(qs)
    slot_T = torch.cat(slots)
    pad = torch.tensor([-1])  # a padding token (slot -1) at the end is skipped by store_kv
    store_kv(
        torch.cat([torch.cat([k[c:] for k, c in zip(ks, cached)]), torch.zeros(1, Hkv, d)]),
        torch.cat([torch.cat([v[c:] for v, c in zip(vs, cached)]), torch.zeros(1, Hkv, d)]),
        k_cache, v_cache, torch.cat([slot_T, pad]),
    )
    out = attend(
        q_THd, k_cache, v_cache,
        torch.tensor([t + [-1] * (M - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor([c + n for c, n in zip(cached, new)], dtype=torch.int32),
        torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32),
        torch.cat(pos), d ** -0.5, max(new), max(c + n for c, n in zip(cached, new)), window,
    )
    ref = torch.cat([_dense(q, k, v, c, d ** -0.5, window) for q, k, v, c in zip(qs, ks, vs, cached)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_store_kv_skips_padding_slots():
    k_cache = torch.zeros(3, 2, 1, 2)
    v_cache = torch.zeros(3, 2, 1, 2)
    k = torch.arange(8.0).view(4, 1, 2) + 1
    store_kv(k, -k, k_cache, v_cache, torch.tensor([-1, 5, -1, 0]))
    flat_k, flat_v = k_cache.view(6, 2), v_cache.view(6, 2)
    assert torch.equal(flat_k[5], k[1, 0]) and torch.equal(flat_k[0], k[3, 0]) and torch.equal(flat_v[5], -k[1, 0])
    assert torch.equal(flat_k[1:5], torch.zeros(4, 2))
    store_kv(k[:2], k[:2], k_cache, v_cache, torch.tensor([-1, -1]))  # all padding: nothing changes
    assert torch.equal(flat_k[5], k[1, 0]) and torch.equal(flat_k[0], k[3, 0]) and flat_k[1:5].abs().sum() == 0


def test_bad_shapes_raise():
    k_cache = torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError, match="do not fit cache"):
        store_kv(torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), k_cache, k_cache, torch.arange(3))
    with pytest.raises(ValueError, match="GQA"):
        paged_attention_ref(
            torch.zeros(2, 3, 8), k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([2]), torch.tensor([0, 2]), torch.arange(2), 1.0, 2, 2,
        )


def test_sdpa_in_bf16_is_close_to_the_reference():
    torch.manual_seed(0)
    Nb, S, Hkv, d, H = 8, 4, 2, 16, 4
    k_cache = torch.randn(Nb, S, Hkv, d).bfloat16()
    v_cache = torch.randn(Nb, S, Hkv, d).bfloat16()
    q = torch.randn(5, H, d).bfloat16()
    args = (torch.tensor([[3, 1, 6], [0, 7, -1]], dtype=torch.int32), torch.tensor([10, 6], dtype=torch.int32),
            torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([7, 8, 9, 4, 5]), d ** -0.5, 3, 10)
    ref = paged_attention_ref(q, k_cache, v_cache, *args)
    out = paged_attention_sdpa(q, k_cache, v_cache, *args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)  # a few bf16 ulps


def test_resolve_attention_backend():
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("auto", "cuda") in ("triton", "sdpa")
    assert resolve_attention_backend("sdpa", "cpu") == "sdpa"
    assert set(ATTENTION_BACKENDS.names()) >= {"torch", "sdpa"}
    with pytest.raises(KeyError, match="unknown attention backend 'flash'"):
        resolve_attention_backend("flash", "cpu")
