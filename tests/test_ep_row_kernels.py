"""EP row kernels (moe_infer.kernels.ep_rows) under the Triton interpreter == their PyTorch references.

Fresh random inputs per case; outputs are poisoned first so an unwritten element shows.
"""
import os

import pytest
import torch

import moe_infer.kernels.ep_ops  # noqa: F401  (registers EP_ROW_OPS["triton"]; conftest set the interpreter on CPU)
from moe_infer.kernels.ep_ops_torch import weight_columns
from moe_infer.kernels.ep_row_ops import EP_ROW_OPS, row_ops
from moe_infer.routing.capacity_ops import expert_ranks_torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs the interpreter or CUDA"
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON, TORCH = EP_ROW_OPS.get("triton"), EP_ROW_OPS.get("torch")


def _routing(T, K, V, drop, gen):
    ids_TK = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(T)]).to(torch.int32) if T else \
        torch.empty(0, K, dtype=torch.int32)
    ids_TK[torch.rand(T, K, generator=gen) < drop] = -1
    return ids_TK.to(DEV)


@pytest.mark.parametrize("T,K,V,C,drop", [(7, 2, 5, 3, 0.2), (33, 4, 8, 2, 0.0), (0, 2, 4, 1, 0.0), (50, 8, 16, 3, 0.3)])
def test_slot_rows(T, K, V, C, drop):
    gen = torch.Generator().manual_seed(T * 31 + V)
    ids_TK = _routing(T, K, V, drop, gen)
    rank_N, _ = expert_ranks_torch(ids_TK, V)
    table_V = torch.randperm(V, generator=gen).to(DEV)  # a slot permutation, as a placement gives
    X = V * C
    dest_t, src_t = TRITON.slot_rows(ids_TK.reshape(-1), rank_N, table_V, C, X)
    dest_r, src_r = TORCH.slot_rows(ids_TK.reshape(-1), rank_N, table_V, C, X)
    assert torch.equal(dest_t, dest_r) and torch.equal(src_t, src_r)
    kept = dest_r < X  # every kept row is where src says, and rows over capacity are not sent
    assert torch.equal(src_r[dest_r[kept]].long(), torch.nonzero(kept).squeeze(1))
    assert not bool(((rank_N >= C) & kept).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,D,X", [(9, 2, 48, 24), (5, 3, 40, 7), (0, 2, 16, 4)])
def test_pack_rows(dtype, T, K, D, X):
    gen = torch.Generator().manual_seed(X * 7 + D)
    x_TD = torch.randn(T, D, generator=gen).to(DEV, dtype)
    w_N = torch.rand(T * K, generator=gen).to(DEV)
    src_X = torch.randint(-1, max(T * K, 1), (X,), generator=gen, dtype=torch.int32).to(DEV)
    if T == 0:
        src_X.fill_(-1)
    W = weight_columns(dtype)
    outs = []
    for ops in (TRITON, TORCH):
        out = torch.full((X, D + W), float("nan"), dtype=dtype, device=DEV)
        outs.append(ops.pack_rows(x_TD, w_N, src_X, K, out))
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
    # a section of a larger buffer (the overlap's micro-batch) is written in place, nothing else
    big = torch.full((X + 3, D + W), 5.0, dtype=dtype, device=DEV)
    TRITON.pack_rows(x_TD, w_N, src_X, K, big[2:2 + X])
    assert torch.equal(big[2:2 + X].view(torch.uint8), outs[1].view(torch.uint8))
    assert bool((big[:2] == 5).all()) and bool((big[2 + X:] == 5).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recv_rows(dtype):
    gen = torch.Generator().manual_seed(3)
    X, D = 37, 24
    W = weight_columns(dtype)
    recv = torch.randn(X, D + W, generator=gen).to(DEV, dtype)
    w_X = torch.rand(X, generator=gen)
    w_X[::3] = 0.0
    recv[:, D:] = w_X.to(DEV).view(dtype).view(X, W)
    slot_X = torch.randint(0, 6, (X,), generator=gen).to(DEV)
    ids_t, wt = TRITON.recv_rows(recv, slot_X, D)
    ids_r, wr = TORCH.recv_rows(recv, slot_X, D)
    assert torch.equal(ids_t, ids_r) and torch.equal(wt, wr) and torch.equal(wr.cpu(), w_X)
    assert bool((ids_r[::3] == -1).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,D", [(6, 2, 40), (11, 4, 2100), (0, 2, 8)])
def test_combine_rows(dtype, T, K, D):
    gen = torch.Generator().manual_seed(T + D)
    X = 3 * T + 2
    y_XD = torch.randn(X, D, generator=gen).to(DEV, dtype)
    dest_N = torch.randint(0, X + 1, (T * K,), generator=gen).to(DEV)  # X: the sentinel, adds nothing
    out_t = TRITON.combine_rows(y_XD, dest_N, T, K)
    out_r = TORCH.combine_rows(y_XD, dest_N, T, K)
    tol = 0 if dtype == torch.float32 else 1e-2  # fp32 -> bf16 truncates in the interpreter (1 ulp)
    assert out_t.shape == (T, D) and torch.allclose(out_t.float(), out_r.float(), atol=tol, rtol=tol)
    if T:
        ref = sum(torch.cat([y_XD, y_XD.new_zeros(1, D)])[dest_N.view(T, K)[:, k]].float() for k in range(K))
        assert torch.allclose(out_r.float(), ref.to(dtype).float(), atol=tol, rtol=tol)


def test_bad_input_names_the_problem():
    x_TD = torch.randn(4, 6, device=DEV)
    with pytest.raises(ValueError, match="weights_N"):
        TRITON.pack_rows(x_TD, torch.rand(3, device=DEV), torch.zeros(2, dtype=torch.int32, device=DEV), 2,
                         torch.empty(2, 7, device=DEV))
    with pytest.raises(ValueError, match="out_XC"):
        TRITON.pack_rows(x_TD, torch.rand(8, device=DEV), torch.zeros(2, dtype=torch.int32, device=DEV), 2,
                         torch.empty(2, 6, device=DEV))
    with pytest.raises(ValueError, match="4-byte"):
        TRITON.recv_rows(torch.empty(3, 7, dtype=torch.bfloat16, device=DEV), torch.zeros(3, dtype=torch.int64,
                                                                                           device=DEV), 5)
    assert row_ops(torch.device("cpu")) is TORCH


def _placement(E, ep, replicas):
    from moe_infer.parallel.placement import contiguous_placement, replicate_hot_experts

    if not replicas:
        return contiguous_placement(E, ep)
    return replicate_hot_experts([float((e * 7) % 5 + 1) for e in range(E)], ep, replicas)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,E,ep,replicas,C,drop,ranges", [
    (9, 2, 8, 2, 0, 3, 0.2, ((0, 4),)), (21, 4, 8, 2, 2, 2, 0.1, ((0, 3), (3, 5))), (0, 2, 4, 2, 0, 1, 0.0, ((0, 2),)),
    (40, 8, 16, 4, 4, 5, 0.3, ((0, 3), (3, 5))), (3, 1, 6, 3, 0, 4, 0.0, ((0, 1), (1, 2))),
])
def test_slot_pack_equals_the_separate_steps(dtype, T, K, E, ep, replicas, C, drop, ranges):
    """slot_pack (one launch) == slot_keys -> expert_ranks -> slot_rows -> pack_rows (the path above
    SLOT_PACK_MAX_ROWS), for the Triton kernel and the reference, on every rank of a placement."""
    from moe_infer.parallel.slots import SlotTables

    gen = torch.Generator().manual_seed(T * 13 + E + replicas)
    D = 24
    W = weight_columns(dtype)
    placement = _placement(E, ep, replicas)
    ids_TK = _routing(T, K, E, drop, gen)
    x_TD = torch.randn(T, D, generator=gen).to(DEV, dtype)
    w_N = torch.rand(T * K, generator=gen).to(DEV)
    for rank in range(ep):
        slots = SlotTables(placement, rank)
        X = placement.num_physical * C
        keys_N, table_V, num_keys = slots.slot_keys(ids_TK, ranges)
        rank_N, _ = expert_ranks_torch(keys_N.view(T, K), num_keys)
        dest_ref, src_X = TORCH.slot_rows(keys_N, rank_N, table_V, C, X)
        send_ref = TORCH.pack_rows(x_TD, w_N, src_X, K, torch.empty(X, D + W, dtype=dtype, device=DEV))
        table_V3 = slots.slot_table(torch.device(DEV), ranges)
        for ops in (TRITON, TORCH):  # one launch per micro-batch of slots [a, b): virtual slots [a*ep, b*ep)
            send = torch.full((X, D + W), float("nan"), dtype=dtype, device=DEV)
            dest = torch.full((T * K,), -7, dtype=torch.int64, device=DEV)
            for a, b in ranges:
                ops.slot_pack(x_TD, ids_TK.reshape(-1).contiguous(), w_N, table_V3, rank, C, K,
                              send[a * ep * C:b * ep * C], dest, a * ep)
            assert torch.equal(dest, dest_ref), (ops, rank)
            assert torch.equal(send.view(torch.uint8), send_ref.view(torch.uint8)), (ops, rank)


def test_slot_pack_bad_input_names_the_problem():
    x_TD = torch.randn(4, 6, device=DEV)
    ids_N = torch.zeros(8, dtype=torch.int32, device=DEV)
    dest_N = torch.empty(8, dtype=torch.int64, device=DEV)
    table = torch.tensor([[0, 0, 1], [1, 0, 1]], dtype=torch.int32, device=DEV)
    w_N = torch.rand(8, device=DEV)
    with pytest.raises(ValueError, match="slots_V3"):
        TRITON.slot_pack(x_TD, ids_N, w_N, table.long(), 0, 2, 2, torch.empty(4, 7, device=DEV), dest_N)
    with pytest.raises(ValueError, match="out_XC"):
        TRITON.slot_pack(x_TD, ids_N, w_N, table, 0, 2, 2, torch.empty(4, 7, device=DEV), dest_N, 1)
    with pytest.raises(ValueError, match="routed rows"):
        TRITON.slot_pack(x_TD, ids_N[:6], w_N[:6], table, 0, 2, 2, torch.empty(4, 7, device=DEV), dest_N[:6])
    with pytest.raises(ValueError, match="dest_N"):
        TRITON.slot_pack(x_TD, ids_N, w_N, table, 0, 2, 2, torch.empty(4, 7, device=DEV), dest_N.int())
