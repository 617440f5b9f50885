"""fp8 (e4m3) KV cache: the store quantizes k / k_scale[h] and v / v_scale[h]; the paged-attention reference, the SDPA
path and the Triton kernel (interpreter on CPU; decode, prefill, mixed steps, split-KV) read it dequantized. Checked
against the float32 path over the same dequantized caches (equal up to float32 order), and against the unquantized
cache within e4m3's error."""
import os

import pytest
import torch

from moe_infer.layers.paged_attention import paged_attention_ref, paged_attention_sdpa, store_kv
from test_paged_attention import DECODE, MIXED, PREFILL, _case

FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.timeout(300)


def _triton(splits):
    def attend(*args, **kw):
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
        from moe_infer.kernels.paged_attention import paged_attention_triton

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        mv = {k: v.to(dev) for k, v in kw.items()}
        return paged_attention_triton(*[a.to(dev) if torch.is_tensor(a) else a for a in args], splits=splits,
                                      **mv).cpu()
    attend.__name__ = f"triton_split{splits}"
    return attend


def _fp8_case(H, Hkv, S, window, new, seed):
    """(args with fp8 caches, per-head scales, args with the dequantized caches in float32, the float32 args)."""
    args, _ = _case(H, Hkv, S, window, new, seed=seed)
    k_cache, v_cache = args[1], args[2]
    k_scale = torch.linspace(0.5, 2.0, Hkv)  # per head; values of N(0, 1) stay far inside e4m3's range
    v_scale = torch.linspace(1.5, 0.25, Hkv)
    k8 = (k_cache / k_scale[:, None]).to(FP8)
    v8 = (v_cache / v_scale[:, None]).to(FP8)
    deq = (args[0], k8.float() * k_scale[:, None], v8.float() * v_scale[:, None]) + args[3:]
    return (args[0], k8, v8) + args[3:], dict(k_scale=k_scale, v_scale=v_scale), deq, args


CASES = [(4, 2, 4, None, MIXED), (8, 1, 5, 4, DECODE), (8, 2, 3, 3, PREFILL), (8, 2, 4, 6, [17, 1, 33, 9])]


@pytest.mark.parametrize("H,Hkv,S,window,new", CASES)
@pytest.mark.parametrize("attend", [paged_attention_ref, paged_attention_sdpa, _triton(1), _triton(2)],
                         ids=lambda f: f.__name__)
def test_fp8_cache_equals_the_dequantized_cache(H, Hkv, S, window, new, attend):
    fp8_args, scales, deq_args, _ = _fp8_case(H, Hkv, S, window, new, seed=H + S)
    want = paged_attention_ref(*deq_args)
    torch.testing.assert_close(attend(*fp8_args, **scales), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H,Hkv,S,window,new", CASES)
def test_fp8_cache_is_close_to_the_unquantized_cache(H, Hkv, S, window, new):
    """e4m3 keeps 3 mantissa bits (relative error <= 2^-4 a value): an output row that sees one key is that value, so
    the worst error is about 2^-4 of the largest |v| (~3 for N(0, 1) values): within 0.25; on average within 0.02
    (outputs average several N(0, 1) values; measured at most 0.11 / 0.014 over these cases)."""
    fp8_args, scales, _, plain = _fp8_case(H, Hkv, S, window, new, seed=H + S)
    diff = (paged_attention_ref(*fp8_args, **scales) - paged_attention_ref(*plain)).abs()
    assert diff.max() <= 0.25 and diff.mean() <= 0.02 and diff.max() > 0, (diff.max(), diff.mean())


def test_store_kv_quantizes_per_head_and_skips_padding():
    k_cache = torch.zeros(3, 2, 2, 4, dtype=FP8)
    v_cache = torch.zeros(3, 2, 2, 4, dtype=FP8)
    k = torch.tensor([[[1.0, -3.0, 1000.0, 0.1], [2.0, 2.0, 2.0, 2.0]]] * 2)  # [T=2, Hkv=2, d=4]
    v = -k
    k_scale, v_scale = torch.tensor([1.0, 4.0]), torch.tensor([0.5, 1.0])
    store_kv(k, v, k_cache, v_cache, torch.tensor([3, -1]), k_scale, v_scale)
    got_k = k_cache.view(6, 2, 4)[3].float()
    assert got_k[0].tolist() == [1.0, -3.0, 448.0, torch.tensor(0.1).to(FP8).float().item()]  # saturated at 448
    assert got_k[1].tolist() == [0.5] * 4 and v_cache.view(6, 2, 4)[3, 0, 0].item() == -2.0
    assert (k_cache.view(6, 2, 4)[[0, 1, 2, 4, 5]].float() == 0).all()  # the padding row wrote nothing


# ---- in the model and the engine ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_model_with_an_fp8_cache_tracks_the_16_bit_cache(backend, tmp_path):
    """The tiny Qwen3-MoE over the parity schedule (prefill chunks, decodes): logits with an fp8 cache near those with
    a float32 cache. e4m3 rounds each K/V value by up to 2^-4 (16x bf16's step); through this tiny random model's 3
    layers the logits move by 7 % of their mean magnitude (CPU: 0.068), as fp8 weights move them by 8-16 %
    (test_fp8_checkpoint.py); a cache read wrong moves them by about their size. Bound: 15 %."""
    if backend == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
    if backend == "triton":
        import moe_infer.layers.attention_triton  # noqa: F401  registers ATTENTION_BACKENDS["triton"]
    from moe_infer.models import load_model
    from paged_sim import PagedSim, run_schedule
    from parity_cases import SCHEDULE, make_tokens
    from tiny_hf import make_tiny_checkpoint

    src = make_tiny_checkpoint("qwen3_moe", tmp_path / "src", seed=3, head_dim=16)
    out = {}
    for kv in ("auto", "fp8"):
        model = load_model(src, torch.float32, "cpu", attn_backend=backend)
        if kv == "fp8":
            model.set_kv_cache_dtype(FP8)
        tokens = make_tokens(model.arch.vocab_size, seed=1)
        sim = PagedSim(model, block_size=4, num_blocks=32)
        assert sim.kv[0][0].dtype == (FP8 if kv == "fp8" else torch.float32)
        out[kv] = torch.cat(list(run_schedule(sim, tokens, SCHEDULE).values()))
    err = (out["fp8"] - out["auto"]).abs().mean() / out["auto"].abs().mean()
    assert 0 < err <= 0.15, err


def test_engine_fp8_cache_and_refusals(tmp_path, caplog):
    import logging

    from moe_infer import LLM, SamplingParams
    from moe_infer.config import CacheConfig
    from tiny_hf import make_tiny_checkpoint

    src = make_tiny_checkpoint("qwen3_moe", tmp_path / "src", seed=3, head_dim=16)
    with caplog.at_level(logging.INFO, logger="moe_infer.engine.model_runner"):
        llm = LLM(model=src, dtype="float32", device="cpu", block_size=4, num_kv_blocks=32, kv_cache_dtype="fp8")
    assert "twice the tokens" in caplog.text
    assert all(t.dtype == FP8 for kv in llm.engine.runner.kv_caches for t in kv)
    out = llm.generate([{"prompt_token_ids": [5, 9, 13, 17]}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                             ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="cache.kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")


# ---- MLA's latent cache (DeepSeek-V3) ----------------------------------------------------------------------------

def _ds_logits(src, dtype, backend, kv_dtype=None, round_rows=False, monkeypatch=None):
    """Logits of the tiny DeepSeek-V3 over the parity schedule; kv_dtype: the cache's; round_rows: the latent rows
    rounded through e4m3 (scale 1) before a 16/32-bit cache stores them (the fp8 cache's values, computed apart)."""
    from moe_infer.layers import mla as mla_mod
    from moe_infer.models import load_model
    from paged_sim import PagedSim, run_schedule
    from parity_cases import SCHEDULE, make_tokens

    if round_rows:
        store = mla_mod.store_rows
        monkeypatch.setattr(mla_mod, "store_rows", lambda rows, cache, slots: store(
            rows.float().clamp(-448, 448).to(FP8).to(rows.dtype), cache, slots))
    model = load_model(src, dtype, "cpu", attn_backend=backend)
    if kv_dtype is not None:
        model.set_kv_cache_dtype(kv_dtype)
    sim = PagedSim(model, block_size=4, num_blocks=32)
    assert sim.kv[0][0].dtype == (kv_dtype or dtype)
    out = torch.cat(list(run_schedule(sim, make_tokens(model.arch.vocab_size, seed=1), SCHEDULE).values())).float()
    if round_rows:
        monkeypatch.undo()
    return out, model.kv_cache_bytes_per_block(4) // 4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mla_fp8_cache_tracks_the_bf16_cache(backend, tmp_path, monkeypatch):
    """The tiny DeepSeek-V3 (3 layers, latent 32 + rope 8) over the parity schedule (prefill chunks, decodes): with
    an e4m3 latent cache, (1) a float32 model's logits equal those of a float32 cache holding the rows rounded through
    e4m3 apart from the cache code (up to float32 order: the store, the decode kernel and the up-projected prompts
    read the right values); (2) a bf16 model's logits stay within 20 % of their mean magnitude of the bf16 cache's
    (measured 0.13-0.16: this random model moves that much under e4m3's 2^-4 steps, as test_fp8_checkpoint's fp8
    weights move it; a cache read wrong moves them by about their size); (3) a token's cache is half the bf16 one."""
    if backend == "triton":
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
        import moe_infer.layers.mla_triton  # noqa: F401  registers MLA_BACKENDS["triton"]
    from tiny_hf import make_tiny_checkpoint

    src = make_tiny_checkpoint("deepseek_v3", tmp_path / "src", seed=3)
    fp8, _ = _ds_logits(src, torch.float32, backend, FP8)
    rounded, _ = _ds_logits(src, torch.float32, backend, round_rows=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(fp8, rounded, atol=1e-4, rtol=1e-4)
    bf16, bf16_bytes = _ds_logits(src, torch.bfloat16, backend)
    bf16_fp8, fp8_bytes = _ds_logits(src, torch.bfloat16, backend, FP8)
    err = (bf16_fp8 - bf16).abs().mean() / bf16.abs().mean()
    assert 0 < err <= 0.2, err
    assert fp8_bytes * 2 == bf16_bytes == 3 * (32 + 8) * 2


def test_engine_runs_deepseek_with_an_fp8_latent_cache(tmp_path, caplog):
    import logging

    from moe_infer import LLM, SamplingParams
    from tiny_hf import make_tiny_checkpoint

    mla = make_tiny_checkpoint("deepseek_v3", tmp_path / "mla", seed=3)
    with caplog.at_level(logging.INFO, logger="moe_infer.engine.model_runner"):
        llm = LLM(model=mla, dtype="float32", device="cpu", block_size=4, num_kv_blocks=32, kv_cache_dtype="fp8_e4m3")
    assert "twice the tokens" in caplog.text
    assert all(t.dtype == FP8 for kv in llm.engine.runner.kv_caches for t in kv)
    out = llm.generate([{"prompt_token_ids": [5, 9, 13, 17]}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                             ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("new,cached", [([1] * 8, (4000, 17, 900, 1, 2047, 64, 333, 1500)),  # decode, split-KV
                                        ([1, 300, 1, 77], (1500, 0, 31, 2000)), ([1000], (0,))])
def test_gpu_triton_fp8_cache_matches_reference(new, cached):
    """Qwen3-30B-A3B's heads (H 32, Hkv 4, d 128), block 16, bf16 queries over an e4m3 cache with per-head scales,
    against the float32 reference on the same cache (the bf16 tolerance of test_paged_attention's GPU test)."""
    from moe_infer.kernels.paged_attention import paged_attention_triton

    Nb = sum(-(-(c + n) // 16) for c, n in zip(cached, new)) + 8
    args, _ = _case(32, 4, 16, None, new, cached=cached, d=128, Nb=Nb, dtype=torch.bfloat16, seed=len(new))
    scales = dict(k_scale=torch.linspace(0.5, 2.0, 4).cuda(), v_scale=torch.linspace(1.5, 0.25, 4).cuda())
    k8 = (args[1].cuda().float() / scales["k_scale"][:, None]).to(FP8)
    v8 = (args[2].cuda().float() / scales["v_scale"][:, None]).to(FP8)
    args = tuple(a.cuda() if torch.is_tensor(a) else a for a in (args[0], k8, v8) + args[3:])
    out = paged_attention_triton(*args, **scales).float()
    torch.testing.assert_close(out, paged_attention_ref(*args, **scales).float(), atol=2e-2, rtol=2e-2)
