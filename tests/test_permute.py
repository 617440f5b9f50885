"""Token permutation: Triton kernels vs the PyTorch reference, and properties of the sorted order,
the inverse map and the block-padded layout (hypothesis)."""
# conftest.py turns the Triton interpreter on when there is no CUDA device (before triton loads).
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from moe_infer.experts.local_dispatch import LocalDispatcher  # noqa: E402
from moe_infer.routing.permute import (  # noqa: E402
    PERMUTE_BACKENDS, align_rows_to_blocks, max_padded_rows, permute_rows,
)
from moe_infer.routing.triton_permute import permute_rows_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("order_R", "inv_N", "token_idx_R", "weights_R", "counts_E", "offsets_E1")
LAYOUT_FIELDS = ("sorted_rows_P", "block_expert_B", "padded_offsets_E1", "num_padded")


def _routing(T, E_total, K, gen, drop_frac=0.1):
    ids_TK = torch.stack([torch.randperm(E_total, generator=gen)[:K] for _ in range(T)]).int() if T else (
        torch.empty(0, K, dtype=torch.int32))
    if T:
        ids_TK[:, :] = torch.where(torch.rand(T, K, generator=gen) < drop_frac, -1, ids_TK)
        ids_TK[0, 0] = ids_TK[-1, -1] if E_total > 1 else 0  # skewed: a repeated expert across tokens
    return ids_TK.to(DEVICE), torch.rand(T, K, generator=gen).to(DEVICE)


def _assert_same(a, b):
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert (a.layout is None) == (b.layout is None)
    if a.layout is not None:
        for f in LAYOUT_FIELDS:
            assert torch.equal(getattr(a.layout, f), getattr(b.layout, f)), f


def _check_properties(perm, ids_TK, w_TK, E, start, block_size):
    N, K = ids_TK.numel(), ids_TK.shape[1]
    ids_N, w_N = ids_TK.reshape(-1).long().cpu(), w_TK.reshape(-1).cpu()
    order_R, inv_N = perm.order_R.cpu(), perm.inv_N.cpu()
    assert torch.equal(order_R[inv_N], torch.arange(N)) and torch.equal(inv_N[order_R], torch.arange(N))
    local_N = (ids_N >= start) & (ids_N < start + E)
    key_R = torch.where(local_N, ids_N - start, torch.full_like(ids_N, E))[order_R]
    assert torch.all(key_R[1:] >= key_R[:-1])  # grouped by expert, non-local rows last
    for e in range(E + 1):  # stable: routed-row order inside each group
        rows = order_R[key_R == e]
        assert torch.all(rows[1:] > rows[:-1])
    assert torch.equal(perm.counts_E.cpu(), torch.bincount(ids_N[local_N] - start, minlength=E))
    assert torch.equal(perm.token_idx_R.cpu(), order_R // K)
    assert torch.equal(perm.weights_R.cpu(), torch.where(local_N[order_R], w_N[order_R], 0.0))
    if block_size is None:
        return
    lay = perm.layout
    P = max_padded_rows(N, E, block_size)
    rows_P, blocks_B = lay.sorted_rows_P.cpu().long(), lay.block_expert_B.cpu().long()
    assert rows_P.shape == (P,) and blocks_B.shape == (P // block_size,)
    real = rows_P[rows_P < N]
    assert sorted(real.tolist()) == sorted(torch.nonzero(local_N).flatten().tolist())  # every local row once
    expert_P = blocks_B.repeat_interleave(block_size)
    assert torch.equal(expert_P[rows_P < N], ids_N[rows_P[rows_P < N]] - start)  # row sits in its expert's block
    used = int(lay.num_padded.item())
    assert used % block_size == 0 and used == int(lay.padded_offsets_E1[-1]) and torch.all(blocks_B[used // block_size:] == -1)
    assert torch.all(blocks_B[: used // block_size] >= 0)


CASES = [(E, K) for E, K in ((6, 1), (6, 4), (8, 2), (8, 8), (60, 4), (128, 8), (256, 8), (256, 1))]


@pytest.mark.parametrize("E,K", CASES)
@pytest.mark.parametrize("block_size", [None, 1, 16, 64])
def test_triton_permute_matches_reference_interpreter(E, K, block_size):
    gen = torch.Generator().manual_seed(E * 10 + K)
    for T, (n_local, start) in ((1, (E, 0)), (23, (E, 0)), (40, (max(1, E // 3), E // 3))):
        ids_TK, w_TK = _routing(T, E, K, gen)
        ref = PERMUTE_BACKENDS.get("torch")(ids_TK, w_TK, n_local, start, block_size)
        out = permute_rows_triton(ids_TK, w_TK, n_local, start, block_size)
        _assert_same(out, ref)
        _check_properties(out, ids_TK, w_TK, n_local, start, block_size)


def test_permute_many_tiles_interpreter():
    gen = torch.Generator().manual_seed(0)
    ids_TK, w_TK = _routing(70, 16, 4, gen)  # N = 280 rows: three tiles of 128
    _assert_same(permute_rows_triton(ids_TK, w_TK, 16, 0, 8), PERMUTE_BACKENDS.get("torch")(ids_TK, w_TK, 16, 0, 8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(0, 30), E=st.integers(1, 12), K=st.integers(1, 4), bs=st.sampled_from([None, 1, 3, 8]),
       seed=st.integers(0, 2**16), split=st.booleans())
def test_permutation_and_inverse_compose_to_identity(T, E, K, bs, seed, split):
    K = min(K, E)
    gen = torch.Generator().manual_seed(seed)
    ids_TK, w_TK = _routing(T, E, K, gen, drop_frac=0.2)
    n_local, start = ((E + 1) // 2, E // 2) if split else (E, 0)
    for backend in ("torch", "triton") if seed % 4 == 0 else ("torch",):
        perm = permute_rows(ids_TK, w_TK, n_local, start, bs, backend=backend)
        _check_properties(perm, ids_TK, w_TK, n_local, start, bs)


def test_align_rows_to_blocks_layout():
    ids_TK = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32, device=DEVICE)
    lay = align_rows_to_blocks(ids_TK, num_experts=3, block_size=4, backend="torch")
    N = 6  # rows: expert 0 <- 1, 4; expert 1 <- 3; expert 2 <- 0, 2, 5
    assert lay.sorted_rows_P.tolist()[:12] == [1, 4, N, N, 3, N, N, N, 0, 2, 5, N]
    assert lay.block_expert_B.tolist()[:4] == [0, 1, 2, -1] and int(lay.num_padded) == 12
    assert torch.equal(align_rows_to_blocks(ids_TK, 3, 4, backend="triton").sorted_rows_P, lay.sorted_rows_P)


def test_dispatcher_uses_the_permute_registry():
    gen = torch.Generator().manual_seed(3)
    ids_TK, w_TK = _routing(12, 8, 2, gen)
    a = LocalDispatcher(8, 4, 2, permute_backend="torch").sort_rows(ids_TK, w_TK, 12)
    b = LocalDispatcher(8, 4, 2, permute_backend="triton").sort_rows(ids_TK, w_TK, 12)
    for f in ("token_idx_R", "weights_R", "counts_E", "offsets_E1", "inv_N"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    with pytest.raises(KeyError, match="permute backend 'nope'"):
        LocalDispatcher(8, permute_backend="nope").sort_rows(ids_TK, w_TK, 12)


def test_permute_errors_name_the_problem():
    ids = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="int32 or int64"):
        permute_rows_triton(ids.float(), ids.float(), 4)
    with pytest.raises(ValueError, match="block_size must be positive"):
        permute_rows(ids, ids.float(), 4, block_size=0, backend="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("E,K", CASES)
def test_triton_permute_full_shapes_gpu(E, K):
    gen = torch.Generator().manual_seed(E + K)
    for T in (1, 257, 4096, 8192):
        ids_TK, w_TK = _routing(T, E, K, gen)
        for bs in (None, 16, 64):
            out = permute_rows_triton(ids_TK, w_TK, E, 0, bs)
            _assert_same(out, PERMUTE_BACKENDS.get("torch")(ids_TK, w_TK, E, 0, bs))
        _check_properties(out, ids_TK, w_TK, E, 0, 64)
