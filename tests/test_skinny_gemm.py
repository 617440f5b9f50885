"""The skinny GEMM (decode-sized linear layers; interpreter on CPU, CUDA with `-m gpu`) against a float32
matmul and against F.linear (cuBLAS on the GPU), its tile rule, and `layers.linear`'s choice of path."""
import os

import pytest
import torch
import torch.nn.functional as F

from moe_infer.layers.linear import LINEAR_KERNELS, graph_kernels, linear

pytestmark = pytest.mark.timeout(300)


def _kernels():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
    return pytest.importorskip("moe_infer.kernels.skinny_gemm")


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


# The interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest even): the 16-bit
# cases run in float16 there and in bfloat16 on the GPU.
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def _naive(x_MK, w_NK, bias_N):
    """A loop of float64 dot products, rounded once: independent of both the kernel and torch's matmul."""
    M, N = x_MK.shape[0], w_NK.shape[0]
    y = torch.empty(M, N, dtype=torch.float64)
    xd, wd = x_MK.double().cpu(), w_NK.double().cpu()
    for m in range(M):
        for n in range(N):
            y[m, n] = (xd[m] * wd[n]).sum() + (bias_N[n].double().cpu() if bias_N is not None else 0.0)
    return y


def _assert_rounded_close(out, ref64):
    """out equals the float64 product up to the float32 sums' order plus one rounding to out's dtype."""
    eps = torch.finfo(out.dtype).eps
    diff = (out.double().cpu() - ref64).abs()
    tol = ref64.abs() * eps + 1e-4 * ref64.abs().max()
    assert (diff <= tol).all(), f"max diff {diff.max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("tiles", [(4, 64), (8, 32), (2, 512)])
def test_kernel_matches_a_naive_loop(dtype, M, tiles):
    """Columns and K not multiples of the tiles (masked edges), several K tiles or one, with a bias."""
    sg = _kernels()
    gen = torch.Generator().manual_seed(M)
    N, K = 37, 300
    x = torch.randn(M, K, generator=gen).to(_device(), dtype)
    w = torch.randn(N, K, generator=gen).to(_device(), dtype)
    b = torch.randn(N, generator=gen).to(_device(), dtype)
    for bias in (None, b):
        out = sg.skinny_gemm(x, w, bias, config=sg.SkinnyConfig(*tiles))
        assert out.shape == (M, N) and out.dtype == dtype
        _assert_rounded_close(out, _naive(x, w, bias))


def test_rows_read_with_their_stride_and_rule_tiles():
    """x a strided view (rows of a wider buffer), the chosen tiles (one K tile holds all of K)."""
    sg = _kernels()
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(3, 200, generator=gen).to(_device())
    x = buf[:, 8:136]  # [3, 128], row stride 200
    w = torch.randn(24, 128, generator=gen).to(_device())
    _assert_rounded_close(sg.skinny_gemm(x, w), _naive(x, w, None))


def test_tile_rule_matches_the_sweep():
    """The best tiles of the H100 sweep (34e25c7:benchmarks/trials/skinny_gemm_sweep.py, docs/notes/removed.md), 132 SMs, one row."""
    sg = _kernels()
    rule = lambda N, K: (lambda c: (c.block_n, c.block_k))(sg.skinny_config(1, N, K, 132))  # noqa: E731
    assert rule(2048, 4096) == (4, 2048)  # Qwen3-30B-A3B o_proj: 512 programs
    assert rule(5120, 2048) == (4, 2048)  # its qkv: 1280 programs
    assert rule(128, 2048) == (4, 2048)  # its router: a whole row
    assert rule(8, 4096) == (4, 4096)  # Mixtral's router: a whole row of 4k
    assert rule(6144, 4096) == (4, 2048)  # Mixtral's qkv
    assert rule(64, 100) == (4, 128)  # K under one tile
    faster = sg.is_faster_than_cublas
    assert faster(1, 5120) and faster(4, 128) and faster(4, 1024)
    assert not faster(2, 5120) and not faster(5, 128)  # wide outputs past one row, any past MAX_ROWS


def test_bad_inputs_name_the_problem():
    sg = _kernels()
    d = _device()
    w = torch.randn(8, 16, device=d)
    with pytest.raises(ValueError, match="at most 4 rows"):
        sg.skinny_gemm(torch.randn(5, 16, device=d), w)
    with pytest.raises(ValueError, match=r"must be \[M, K\] and \[N, K\]"):
        sg.skinny_gemm(torch.randn(1, 15, device=d), w)
    with pytest.raises(ValueError, match="must match x"):
        sg.skinny_gemm(torch.randn(1, 16, device=d, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="bias"):
        sg.skinny_gemm(torch.randn(1, 16, device=d), w, torch.randn(7, device=d))
    with pytest.raises(ValueError, match="power of two"):
        sg.SkinnyConfig(block_n=3)


def test_linear_on_cpu_is_f_linear():
    """CPU tensors never take a kernel path: the result is F.linear's, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 32, generator=gen), torch.randn(16, 32, generator=gen), torch.randn(16, generator=gen)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096), (128, 2048), (8, 4096), (6144, 2048)])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_gpu_decode_shapes_against_cublas(N, K, M):
    """The model shapes the rule was measured on (bf16): within float32-sum-order of cuBLAS's result."""
    sg = _kernels()
    gen = torch.Generator().manual_seed(N + M)
    x = torch.randn(M, K, generator=gen).cuda().bfloat16()
    w = (torch.randn(N, K, generator=gen) * 0.02).cuda().bfloat16()
    b = torch.randn(N, generator=gen).cuda().bfloat16()
    for bias in (None, b):
        out = sg.skinny_gemm(x, w, bias)
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=1e-2)
        assert (out == ref.bfloat16()).float().mean() > 0.95


@pytest.mark.gpu
def test_gpu_linear_takes_the_kernel_for_a_few_16bit_rows_in_a_graph():
    from moe_infer.plugins import load_plugins

    load_plugins()
    assert "triton" in LINEAR_KERNELS, "the plugin is not registered (moe_infer.plugins.load_plugins)"
    sg = _kernels()
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=gen).cuda().bfloat16()
    wide = torch.randn(2048, 512, generator=gen).cuda().bfloat16()
    x5 = torch.randn(5, 512, generator=gen).cuda().bfloat16()

    def in_graph(fn):
        """fn's result captured as a CUDA graph by the engine's own capture (which selects the kernels), replayed."""
        from moe_infer.engine.cuda_graph import capture_graph

        graph, out = capture_graph(fn, torch.zeros(1, dtype=torch.bool, device="cuda"), None)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    for M in (1, 4):  # one row, or a few into a narrow (router-sized) output: the kernel
        x = torch.randn(M, 512, generator=gen).cuda().bfloat16()
        assert torch.equal(in_graph(lambda: linear(x, w)), sg.skinny_gemm(x, w))
        assert torch.equal(linear(x, w), F.linear(x, w))  # eagerly: cuBLAS (host time, not GPU time, bounds it)
        with graph_kernels():
            assert torch.equal(linear(x, w), sg.skinny_gemm(x, w))
    assert torch.equal(in_graph(lambda: linear(x5, w)), F.linear(x5, w))  # past MAX_ROWS: cuBLAS
    # two rows into a wide output: cuBLAS
    assert torch.equal(in_graph(lambda: linear(x5[:2], wide)), F.linear(x5[:2], wide))
    x32, w32 = x5[:1].float(), w.float()
    assert torch.equal(in_graph(lambda: linear(x32, w32)), F.linear(x32, w32))  # float32: cuBLAS
