"""The one-token experts path (matrix-vector kernels; interpreter on CPU, CUDA with `-m gpu`) against a
naive float64 loop, against its PyTorch reference bit for bit where the sums allow, and `fused_experts`'
choice of path."""
import os

import pytest
import torch
import torch.nn.functional as F

from moe_infer.kernels.fused_moe import fused_experts

pytestmark = pytest.mark.timeout(300)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest even): 16-bit cases run
# in float16 there and in bfloat16 on the GPU.
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def _gemv():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CUDA or under TRITON_INTERPRET=1")
    return pytest.importorskip("moe_infer.kernels.expert_gemv")


def _naive(x_TD, ids_TK, w_TK, w13, w2, start):
    """float64 loops over tokens, routed rows and output columns: independent of the kernels and of matmul."""
    E, F2, D = w13.shape
    Fh = F2 // 2
    xd, w13d, w2d = x_TD.double().cpu(), w13.double().cpu(), w2.double().cpu()
    out = torch.zeros(x_TD.shape, dtype=torch.float64)
    for t in range(x_TD.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k]) - start
            if int(ids_TK[t, k]) < 0 or not 0 <= e < E:
                continue
            h = [(w13d[e, j] * xd[t]).sum() for j in range(F2)]
            act = torch.tensor([float(F.silu(h[j]) * h[j + Fh]) for j in range(Fh)], dtype=torch.float64)
            for d in range(D):
                out[t, d] += float(w_TK[t, k]) * (w2d[e, d] * act).sum()
    return out


def _inputs(T, K, E, D, Fh, E_total, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    logits = torch.randn(T, E_total, generator=gen)
    w_TK, ids_TK = torch.softmax(logits, -1).topk(K, dim=-1)
    w13 = torch.randn(E, 2 * Fh, D, generator=gen) * D ** -0.5
    w2 = torch.randn(E, D, Fh, generator=gen) * Fh ** -0.5
    to = lambda t: t.to(DEV, dtype)  # noqa: E731
    return to(x), ids_TK.int().to(DEV), w_TK.to(DEV), to(w13), to(w2)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("K,E,D,Fh,start,E_total,tiles", [
    (1, 1, 16, 8, 0, 1, (4, 16, 4, 8)),
    (4, 5, 40, 24, 0, 5, (4, 16, 4, 8)),  # D and F not multiples of the tiles, several tiles of each
    (3, 4, 32, 20, 2, 9, (2, 32, 8, 32)),  # experts of other ranks on both sides; one tile covers F
])
def test_kernels_match_a_naive_loop(dtype, K, E, D, Fh, start, E_total, tiles):
    g = _gemv()
    x, ids_TK, w_TK, w13, w2 = _inputs(1, K, E, D, Fh, E_total, dtype, seed=K * 7 + E)
    if K > 1:
        ids_TK[0, 1] = -1  # a dropped row
    out = g.expert_gemv(x, ids_TK, w_TK, w13, w2, start, g.GemvConfig(*tiles))
    assert out.shape == x.shape and out.dtype == dtype
    ref64 = _naive(x, ids_TK, w_TK, w13, w2, start)
    # float32: sum order only; 16-bit: act and each weighted row are rounded to dtype (the kernels' contract)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    diff = (out.double().cpu() - ref64).norm() / ref64.norm().clamp_min(1e-30)
    assert diff < tol, f"relative error {diff:.3g}"
    # the reference with the same rounding steps: equal up to float32 sum order, then one rounding
    ref = g.expert_gemv_torch(x, ids_TK, w_TK, w13, w2, start)
    torch.testing.assert_close(out.float(), ref.float(), rtol=torch.finfo(dtype).eps * 2, atol=1e-5)


def test_token_without_local_rows_gets_zeros():
    g = _gemv()
    x, ids_TK, w_TK, w13, w2 = _inputs(1, 2, 3, 16, 8, 9, torch.float32, seed=3)
    ids_TK[0] = torch.tensor([5, -1], dtype=torch.int32)  # another rank's expert and a dropped row
    out = g.expert_gemv(x, ids_TK, w_TK, w13, w2, 0, g.GemvConfig(4, 16, 4, 8))
    assert torch.count_nonzero(out) == 0


def test_tile_rule_and_bad_inputs():
    g = _gemv()
    assert g.gemv_config(2048, 768, 8) == g.GemvConfig(4, 2048, 2, 1024)  # Qwen3-30B-A3B: whole rows
    assert g.gemv_config(4096, 14336, 2) == g.GemvConfig(4, 2048, 4, 1024)  # Mixtral: row tiles
    assert g.gemv_config(7168, 2048, 8) == g.GemvConfig(4, 2048, 2, 1024)  # DeepSeek-V3
    assert g.gemv_config(40, 24, 3) == g.GemvConfig(4, 64, 4, 32)
    x, ids_TK, w_TK, w13, w2 = _inputs(1, 2, 3, 16, 8, 3, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"must be \[3, 16, 8\]"):
        g.expert_gemv(x, ids_TK, w_TK, w13, w2[:, :, :4])
    with pytest.raises(ValueError, match="must match x"):
        g.expert_gemv(x, ids_TK, w_TK, w13.double(), w2)
    with pytest.raises(ValueError, match="disagree"):
        g.expert_gemv(x, ids_TK[:, :1], w_TK, w13, w2)
    with pytest.raises(ValueError, match="power of two"):
        g.GemvConfig(block_d=3)


def test_fused_experts_takes_the_path_at_one_token(monkeypatch):
    """One token without a config: this path's bits; with MOE_EXPERT_GEMV=0, or two tokens: the tile GEMMs."""
    g = _gemv()
    x, ids_TK, w_TK, w13, w2 = _inputs(2, 2, 4, 32, 16, 4, torch.float32, seed=1)
    one = fused_experts(x[:1], ids_TK[:1], w_TK[:1], w13, w2)
    assert torch.equal(one, g.expert_gemv(x[:1], ids_TK[:1], w_TK[:1], w13, w2))
    monkeypatch.setenv(g.ENV, "0")
    tiles = fused_experts(x[:1], ids_TK[:1], w_TK[:1], w13, w2)
    torch.testing.assert_close(tiles, one, rtol=1e-5, atol=1e-6)
    assert not g.use_expert_gemv(x, 2)


MODEL_SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768),
                "olmoe": (64, 8, 2048, 1024), "deepseek_v3": (64, 8, 7168, 2048)}  # an EP rank's 64 of 256


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODEL_SHAPES))
def test_gpu_model_shapes_against_the_tile_gemms(name):
    """bf16 at the model shapes: the same roundings as the tile path, so nearly the same bits; both near
    a float32 loop."""
    from moe_infer.kernels.fused_moe_ref import fused_experts_ref

    g = _gemv()
    E, K, D, Fh = MODEL_SHAPES[name]
    x, ids_TK, w_TK, w13, w2 = _inputs(1, K, E, D, Fh, E, torch.bfloat16, seed=E)
    out = g.expert_gemv(x, ids_TK, w_TK, w13, w2)
    ref = fused_experts_ref(x, ids_TK, w_TK, w13, w2)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    os.environ[g.ENV] = "0"
    try:
        tiles = fused_experts(x, ids_TK, w_TK, w13, w2)
    finally:
        del os.environ[g.ENV]
    torch.testing.assert_close(out, tiles, rtol=1.6e-2, atol=1e-2)
    assert (out == tiles).float().mean() > 0.75


@pytest.mark.gpu
def test_gpu_graph_replays_fresh_routing_and_pdl_keeps_the_bits(monkeypatch):
    """Captured once, replayed with new ids and weights: the down kernel reads the ids before its PDL wait."""
    g = _gemv()
    E, K, D, Fh = MODEL_SHAPES["qwen3"]
    x, ids_TK, w_TK, w13, w2 = _inputs(1, K, E, D, Fh, E, torch.bfloat16, seed=2)
    g.expert_gemv(x, ids_TK, w_TK, w13, w2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.expert_gemv(x, ids_TK, w_TK, w13, w2)
    for seed in range(3):
        nx, nids, nw, _, _ = _inputs(1, K, E, 8, 8, E, torch.bfloat16, seed=10 + seed)
        ids_TK.copy_(nids)
        w_TK.copy_(nw)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, g.expert_gemv(x, ids_TK, w_TK, w13, w2))
    with_pdl = out.clone()
    monkeypatch.setenv("MOE_FUSED_PDL", "0")
    assert torch.equal(with_pdl, g.expert_gemv(x, ids_TK, w_TK, w13, w2))
