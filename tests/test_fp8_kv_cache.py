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
