"""The one-launch RMSNorm kernel (interpreter on CPU, CUDA with `-m gpu`) against transformers' own
RMSNorm module (Qwen3-MoE's), and the decoder's fused residual adds against the unfused layer."""
import os

import pytest
import torch

from moe_infer.layers.norm import RMSNorm, rms_norm_torch

pytestmark = pytest.mark.timeout(300)


def _kernels():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
    return pytest.importorskip("moe_infer.kernels.rms_norm")


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


# The interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest even), so the
# 16-bit cases run in float16 there and in bfloat16 on the GPU.
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def _hf_norm(weight: torch.Tensor, eps: float):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    norm = Qwen3MoeRMSNorm(weight.shape[0], eps=eps).to(weight.device, weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def _assert_ulp_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for float32 sums reduced in another order: at most one ulp of the dtype, rarely."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        return
    eps = torch.finfo(out.dtype).eps
    diff = (out.float() - ref.float()).abs()
    assert (diff <= eps * ref.float().abs().clamp_min(1e-30) * 2 + 1e-30).all(), diff.max()
    assert (out == ref).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("N", [64, 96])
def test_norm_matches_transformers(dtype, N):
    k = _kernels()
    dev = _device()
    g = torch.Generator().manual_seed(N)
    x = (torch.randn(5, N, generator=g) * 3).to(dev, dtype)
    w = (torch.rand(N, generator=g) + 0.5).to(dev, dtype)
    ref = _hf_norm(w, 1e-6)(x)
    _assert_ulp_close(k.rms_norm_triton(x, w, 1e-6), ref)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_per_head_norm_on_a_strided_view(dtype):
    """Qwen3's q norm: [T, H, d] rows of a column slice of the fused qkv projection."""
    k = _kernels()
    dev = _device()
    g = torch.Generator().manual_seed(1)
    T, H, Hkv, d = 3, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * Hkv) * d, generator=g).to(dev, dtype)
    q_THd = qkv[:, :H * d].reshape(T, H, d)
    assert not q_THd.is_contiguous()
    w = (torch.rand(d, generator=g) + 0.5).to(dev, dtype)
    out = k.rms_norm_triton(q_THd, w, 1e-6)
    _assert_ulp_close(out, _hf_norm(w, 1e-6)(q_THd.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_add_norm_matches_add_then_transformers(dtype):
    k = _kernels()
    dev = _device()
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 64, generator=g).to(dev, dtype)
    delta = torch.randn(4, 64, generator=g).to(dev, dtype)
    w = (torch.rand(64, generator=g) + 0.5).to(dev, dtype)
    h_new, y = k.add_rms_norm_triton(h, delta, w, 1e-5)
    assert torch.equal(h_new, h + delta)  # one rounding of the sum, as torch's add
    _assert_ulp_close(y, _hf_norm(w, 1e-5)(h + delta))


def test_bad_shapes_are_refused():
    k = _kernels()
    x = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match=r"\[T, N\] or \[T, H, N\]"):
        k.rms_norm_triton(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        k.rms_norm_triton(torch.randn(2, 8), torch.ones(4), 1e-6)


def test_torch_path_is_transformers():
    """The CPU path (and the reference of the kernel in the engine) is transformers' RMSNorm exactly."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=g).to(torch.bfloat16)
    w = (torch.rand(32, generator=g) + 0.5).to(torch.bfloat16)
    assert torch.equal(rms_norm_torch(x, w, 1e-6), _hf_norm(w, 1e-6)(x))
    norm = RMSNorm(32, 1e-6, torch.bfloat16)
    norm.weight.data.copy_(w)
    h, y = norm.add_forward(x, x)
    assert torch.equal(h, x + x) and torch.equal(y, _hf_norm(w, 1e-6)(x + x))


@pytest.mark.gpu
def test_engine_norms_use_the_kernel_on_cuda():
    """On CUDA RMSNorm dispatches to the registered kernel, and its output stays transformers' within an ulp."""
    from moe_infer.plugins import load_plugins
    from moe_infer.layers.norm import RMS_NORM_KERNELS

    load_plugins()
    assert "triton" in RMS_NORM_KERNELS
    norm = RMSNorm(2048, 1e-6, torch.bfloat16).cuda()
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16) * 4
    _assert_ulp_close(norm(x), _hf_norm(norm.weight.data, 1e-6)(x))
    d = torch.randn_like(x)
    h, y = norm.add_forward(x, d)
    assert torch.equal(h, x + d)
    _assert_ulp_close(y, _hf_norm(norm.weight.data, 1e-6)(x + d))
