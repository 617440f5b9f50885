"""The paged-attention reference, the SDPA path and the Triton kernel (interpreter on CPU, CUDA with
`-m gpu`) against dense causal attention computed sequence by sequence."""
import os

import pytest
import torch

from moe_infer.layers.paged_attention import (
    ATTENTION_BACKENDS, paged_attention_ref, paged_attention_sdpa, resolve_attention_backend, store_kv,
)


def _dense(q_LHd, k_LHd, v_LHd, start, scale, window, sinks_H=None):
    """Queries at positions start..start+Lq-1 over keys 0..L-1 (GQA by repeating K/V); sinks_H: exp(sink) more
    in each head's softmax denominator (written as HF's GPT-OSS eager attention does it: a concatenated column)."""
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
    if sinks_H is not None:
        col = sinks_H.float()[:, None, None].expand(-1, s.shape[1], 1)
        return torch.einsum("hqk,khd->qhd", torch.softmax(torch.cat([s, col], -1), -1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


MIXED, DECODE, PREFILL = [1, 7, 2, 4], [1, 1, 1, 1], [3, 7, 2, 4]  # this step's tokens per sequence


def _triton(splits, heavy_first=None):
    def attend(*args, **kw):
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
        kernels = pytest.importorskip("moe_infer.kernels.paged_attention")
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return kernels.paged_attention_triton(*[a.to(dev) if torch.is_tensor(a) else a for a in args],
                                              splits=splits, heavy_first=heavy_first,
                                              **{k: v.to(dev) for k, v in kw.items()}).cpu()
    attend.__name__ = f"triton_split{splits}" + ("" if heavy_first is None else f"_heavy_first_{heavy_first}")
    return attend


# both program orders (the longest query tiles first, or in order): the wrapper picks one by the grid's size
ATTENDS = [paged_attention_ref, paged_attention_sdpa, _triton(1), _triton(2), _triton(4), _triton(1, True),
           _triton(2, True), _triton(1, False)]


def _case(H, Hkv, S, window, new, cached=(5, 0, 11, 3), d=8, Nb=40, dtype=torch.float32, seed=0, sinks_H=None):
    """Caches (NaN where never written) with earlier tokens stored, this step's tokens stored (plus a
    padding slot), the attention arguments, and the dense reference of every query."""
    torch.manual_seed(seed)
    k_cache = torch.full((Nb, S, Hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((Nb, S, Hkv, d), float("nan"), dtype=dtype)
    free = torch.randperm(Nb).tolist()
    tables, ks, vs, qs, slots, pos = [], [], [], [], [], []
    for c, n in zip(cached, new):
        L = c + n
        blocks = [free.pop() for _ in range(-(-L // S))]
        tables.append(blocks)
        k, v = torch.randn(L, Hkv, d).to(dtype), torch.randn(L, Hkv, d).to(dtype)
        ks.append(k), vs.append(v), qs.append(torch.randn(n, H, d).to(dtype))
        all_slots = torch.tensor([blocks[j // S] * S + j % S for j in range(L)])
        store_kv(k[:c], v[:c], k_cache, v_cache, all_slots[:c])  # an earlier step's tokens
        slots.append(all_slots[c:])
        pos.append(torch.arange(c, L))
    M = max(len(t) for t in tables)
    slot_T = torch.cat(slots)
    pad = torch.tensor([-1])  # a padding token (slot -1) at the end is skipped by store_kv
    store_kv(
        torch.cat([torch.cat([k[c:] for k, c in zip(ks, cached)]), torch.zeros(1, Hkv, d, dtype=dtype)]),
        torch.cat([torch.cat([v[c:] for v, c in zip(vs, cached)]), torch.zeros(1, Hkv, d, dtype=dtype)]),
        k_cache, v_cache, torch.cat([slot_T, pad]),
    )
    args = (
        torch.cat(qs), k_cache, v_cache,
        torch.tensor([t + [-1] * (M - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor([c + n for c, n in zip(cached, new)], dtype=torch.int32),
        torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32),
        torch.cat(pos), d ** -0.5, max(new), max(c + n for c, n in zip(cached, new)), window,
    )
    ref = torch.cat([_dense(q.float(), k.float(), v.float(), c, d ** -0.5, window, sinks_H)
                     for q, k, v, c in zip(qs, ks, vs, cached)])
    return args, ref


@pytest.mark.parametrize("H,Hkv,S,window,new", [
    (4, 2, 4, None, MIXED), (6, 6, 3, None, MIXED), (8, 1, 5, 4, MIXED), (4, 2, 16, None, MIXED),
    (4, 2, 4, None, DECODE), (8, 1, 5, 4, DECODE), (4, 2, 4, None, PREFILL), (8, 2, 3, 3, PREFILL),
    # several query tiles per sequence (8 or 16 tokens a tile on CPU), of unequal counts, in both program
    # orders (ATTENDS)
    (8, 1, 5, None, [1, 40, 19, 2]), (8, 2, 4, 6, [17, 1, 33, 9]),
])
@pytest.mark.parametrize("attend", ATTENDS, ids=lambda f: f.__name__)
def test_matches_dense(H, Hkv, S, window, new, attend):
    args, ref = _case(H, Hkv, S, window, new, seed=H * 10 + S)
    torch.testing.assert_close(attend(*args), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("new,window", [([1, 1, 1], None), ([1, 9, 1], None), ([1, 1, 1], 20)])
def test_triton_split_kv_over_long_contexts(splits, new, window):
    """Contexts of up to 90 keys: with 16-key tiles on CPU every split holds keys (the merge is exercised)."""
    args, ref = _case(8, 2, 8, window, new, cached=(40, 3, 89), d=16, Nb=32, seed=splits)
    torch.testing.assert_close(_triton(splits)(*args), ref, atol=1e-5, rtol=1e-5)


def _sinks(H, seed):
    """Sink logits from far below the scores to far above them (the kernels rescale by the larger)."""
    return (torch.linspace(-6.0, 9.0, H)[torch.randperm(H, generator=torch.Generator().manual_seed(seed))]).contiguous()


@pytest.mark.parametrize("H,Hkv,S,window,new", [
    (4, 2, 4, None, MIXED), (8, 1, 5, 4, MIXED), (4, 2, 4, 3, DECODE), (8, 2, 3, None, PREFILL),
    (8, 2, 4, 6, [17, 1, 33, 9]),
])
@pytest.mark.parametrize("attend", ATTENDS, ids=lambda f: f.__name__)
def test_sinks_match_dense(H, Hkv, S, window, new, attend):
    """GPT-OSS's attention sinks (a logit per head in the denominator), with and without a sliding window."""
    sinks = _sinks(H, seed=H + S)
    args, ref = _case(H, Hkv, S, window, new, seed=H * 10 + S + 1, sinks_H=sinks)
    torch.testing.assert_close(attend(*args, sinks_H=sinks), ref, atol=1e-5, rtol=1e-5)
    _, ref_plain = _case(H, Hkv, S, window, new, seed=H * 10 + S + 1)
    assert not torch.allclose(ref, ref_plain, atol=1e-3)  # the sinks change the output


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 20])
def test_triton_split_kv_with_sinks(splits, window):
    """The split merge adds the sinks once (a split that saw no key of a window included)."""
    sinks = _sinks(8, seed=splits)
    args, ref = _case(8, 2, 8, window, [1, 1, 1], cached=(40, 3, 89), d=16, Nb=32, seed=splits, sinks_H=sinks)
    torch.testing.assert_close(_triton(splits)(*args, sinks_H=sinks), ref, atol=1e-5, rtol=1e-5)


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
    # CUDA: the paged Triton kernel where triton imports (measured faster on the H100), else SDPA
    assert resolve_attention_backend("auto", "cuda") == ("triton" if "triton" in ATTENTION_BACKENDS else "sdpa")
    assert resolve_attention_backend("sdpa", "cpu") == "sdpa"
    assert set(ATTENTION_BACKENDS.names()) >= {"torch", "sdpa"}
    with pytest.raises(KeyError, match="unknown attention backend 'flash'"):
        resolve_attention_backend("flash", "cpu")


def test_triton_backend_is_refused_on_cpu_without_the_interpreter(monkeypatch):
    pytest.importorskip("moe_infer.layers.attention_triton")
    assert resolve_attention_backend("auto", "cuda") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend=triton .* needs a CUDA device"):
        resolve_attention_backend("triton", "cpu")


def test_decode_split_count():
    """Split-KV only for decode steps that leave SMs idle: up to 2048 keys one wave of programs with >= 32 keys a
    split (no pair of splits over <= 256 keys), longer contexts about two waves with >= 128 keys a split."""
    kernels = pytest.importorskip("moe_infer.kernels.paged_attention")
    sms = 132
    assert kernels.num_splits(4, 2048, 1, sms) == 32  # one sequence, 4 KV heads: 128 programs
    assert kernels.num_splits(4, 256, 1, sms) == 8  # 32 keys a split
    assert kernels.num_splits(4, 128, 1, sms) == 4
    assert kernels.num_splits(4, 63, 1, sms) == 1  # fewer than 2 x 32 keys
    assert kernels.num_splits(16, 2048, 1, sms) == 8
    assert kernels.num_splits(64, 512, 1, sms) == 2
    assert kernels.num_splits(64, 256, 1, sms) == 1  # two splits of 128 keys: not worth the merge
    assert kernels.num_splits(4, 8192, 1, sms) == 64  # long: two waves
    assert kernels.num_splits(64, 8192, 1, sms) == 4
    assert kernels.num_splits(256, 8192, 1, sms) == 1  # the batch fills the SMs
    assert kernels.num_splits(4, 8192, 2, sms) == 1  # not a decode step


def test_decode_key_tile():
    """Half a split's keys, 32 to 128, at most 32 KiB of keys; 64 where the batch fills the SMs."""
    kernels = pytest.importorskip("moe_infer.kernels.paged_attention")
    sms, bf16_row, f32_row = 132, 128 * 2, 128 * 4
    assert kernels.decode_block_n(4, 256, 8, sms, bf16_row) == 32  # 32 keys a split
    assert kernels.decode_block_n(4, 2048, 32, sms, bf16_row) == 32
    assert kernels.decode_block_n(16, 1024, 8, sms, bf16_row) == 64
    assert kernels.decode_block_n(16, 2048, 8, sms, bf16_row) == 128
    assert kernels.decode_block_n(16, 2048, 8, sms, f32_row) == 64  # 32 KiB of float32 keys
    assert kernels.decode_block_n(4, 8192, 64, sms, bf16_row) == 64
    assert kernels.decode_block_n(256, 8192, 1, sms, bf16_row) == 64


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("new,cached", [
    ([1] * 8, (4000, 17, 900, 1, 2047, 64, 333, 1500)),  # decode, long contexts: split-KV chosen
    ([1], (8191,)),  # decode, one sequence: 64 splits of 128 keys
    ([1] * 64, tuple(range(100, 6500, 100))),  # decode, a batch wide enough for no split
    ([1, 300, 1, 77], (1500, 0, 31, 2000)),  # mixed: prefill chunks (one after a cached prefix) beside decodes
    ([1000], (0,)),  # one prompt: the wrapper dispatches the longest query tiles first
])
@pytest.mark.parametrize("heavy_first", [None, True, False], ids=["chosen", "heavy-first", "in-order"])
def test_triton_matches_reference_gpu(dtype, new, cached, heavy_first):
    """Qwen3-30B-A3B's attention shape (H=32, Hkv=4, d=128), block size 16, against the float32 reference."""
    kernels = pytest.importorskip("moe_infer.kernels.paged_attention")
    Nb = sum(-(-(c + n) // 16) for c, n in zip(cached, new)) + 8
    args, _ = _case(32, 4, 16, None, new, cached=cached, d=128, Nb=Nb, dtype=dtype, seed=len(new))
    args = tuple(a.cuda() if torch.is_tensor(a) else a for a in args)
    ref = paged_attention_ref(*args).float()
    out = kernels.paged_attention_triton(*args, heavy_first=heavy_first).float()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    window = kernels.paged_attention_triton(*args[:-1], 256, heavy_first=heavy_first).float()  # a 256-key window
    torch.testing.assert_close(window, paged_attention_ref(*args[:-1], 256).float(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("new,cached", [
    ([1] * 8, (4000, 17, 900, 1, 2047, 64, 333, 1500)),  # decode, long contexts: split-KV chosen
    ([1, 300, 1, 77], (1500, 0, 31, 2000)),  # mixed: prefill chunks beside decodes
])
@pytest.mark.parametrize("window", [None, 128])
def test_triton_sinks_gpt_oss_shape_gpu(dtype, new, cached, window):
    """GPT-OSS's attention (H=64, Hkv=8, d=64, block 16; sliding layers: 128 keys) with sinks, against the float32
    reference."""
    kernels = pytest.importorskip("moe_infer.kernels.paged_attention")
    Nb = sum(-(-(c + n) // 16) for c, n in zip(cached, new)) + 8
    args, _ = _case(64, 8, 16, window, new, cached=cached, d=64, Nb=Nb, dtype=dtype, seed=len(new))
    args = tuple(a.cuda() if torch.is_tensor(a) else a for a in args)
    sinks = _sinks(64, seed=1).cuda()
    ref = paged_attention_ref(*args, sinks_H=sinks).float()
    out = kernels.paged_attention_triton(*args, sinks_H=sinks).float()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
