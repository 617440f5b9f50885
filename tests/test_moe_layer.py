"""The MoE layer's pieces (router reference, local dispatcher, reference experts, combine) against a
naive per-token computation."""
import pytest
import torch
import torch.nn.functional as F

from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.experts.reference import experts_torch
from moe_infer.layers.moe import MoEBackends, MoELayer
from moe_infer.routing.spec import RoutingSpec
from moe_infer.routing.stats import ExpertLoadStats


def _naive_moe(x_TD, ids_TK, w_TK, w13_E2FD, w2_EDF):
    F_ = w2_EDF.shape[2]
    out_TD = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            if e < 0:
                continue
            h = w13_E2FD[e] @ x_TD[t]
            out_TD[t] += w_TK[t, k] * (w2_EDF[e] @ (F.silu(h[:F_]) * h[F_:]))
    return out_TD


@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (7, 6, 2), (16, 8, 4), (5, 3, 3)])
def test_layer_matches_naive(T, E, K):
    torch.manual_seed(T * 100 + E)
    D, F_ = 12, 10
    stats = ExpertLoadStats(1, E, "cpu")
    layer = MoELayer(0, D, F_, RoutingSpec(num_experts=E, top_k=K), MoEBackends(stats=stats), torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.4)
    x_TD = torch.randn(T, D)
    with torch.no_grad():
        out_TD = layer(x_TD)
        probs_TE = torch.softmax(layer.gate(x_TD), -1)
        w_TK, ids_TK = probs_TE.topk(K, dim=-1)
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
        ref_TD = _naive_moe(x_TD, ids_TK, w_TK, layer.store.w13_E2FD, layer.store.w2_EDF)
    torch.testing.assert_close(out_TD, ref_TD, atol=1e-5, rtol=1e-5)
    assert int(stats.routed_LE.sum()) == T * K


def test_non_local_and_dropped_rows_contribute_nothing():
    torch.manual_seed(0)
    T, E, K, D, F_ = 9, 6, 2, 8, 4
    x_TD = torch.randn(T, D)
    ids_TK = torch.randint(0, E, (T, K), dtype=torch.int32)
    ids_TK[0, 1] = -1  # a dropped row
    w_TK = torch.rand(T, K)
    w13 = torch.randn(E, 2 * F_, D)
    w2 = torch.randn(E, D, F_)
    total_TD = torch.zeros(T, D)
    for start, n in ((0, 2), (2, 3), (5, 1)):  # three "ranks" owning contiguous experts
        disp = LocalDispatcher(E, num_local_experts=n, expert_start=start)
        x_RD, meta = disp.dispatch(x_TD, ids_TK, w_TK)
        assert x_RD.shape[0] == T * K
        y_RD = experts_torch(x_RD, meta, w13[start:start + n], w2[start:start + n])
        assert torch.all(y_RD[int(meta.offsets_E1[-1]):] == 0)
        total_TD += disp.combine(y_RD, meta)
    torch.testing.assert_close(total_TD, _naive_moe(x_TD, ids_TK, w_TK, w13, w2), atol=1e-4, rtol=1e-4)


def test_dispatch_groups_rows_by_expert_and_inverse_restores_order():
    torch.manual_seed(1)
    T, E, K = 11, 5, 3
    ids_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    disp = LocalDispatcher(E)
    meta = disp.sort_rows(ids_TK, torch.rand(T, K), T)
    order_R = meta.inv_N.argsort()  # dispatched row r holds routed row order_R[r]
    assert torch.equal(meta.token_idx_R, order_R // K)
    sorted_ids_R = ids_TK.reshape(-1)[order_R]
    assert torch.all(sorted_ids_R[1:] >= sorted_ids_R[:-1])
    assert meta.counts_E.tolist() == torch.bincount(ids_TK.reshape(-1).long(), minlength=E).tolist()
    assert torch.equal(order_R.index_select(0, meta.inv_N), torch.arange(T * K))


def test_grouped_sigmoid_routing_respects_groups():
    torch.manual_seed(2)
    spec = RoutingSpec(num_experts=16, top_k=4, scoring="sigmoid", num_expert_group=4, topk_group=2,
                       routed_scaling_factor=2.5, has_score_bias=True)
    from moe_infer.routing.select import select_experts_torch

    logits_TE = torch.randn(32, 16)
    w_TK, ids_TK = select_experts_torch(logits_TE, spec, torch.randn(16) * 0.1)
    groups_TK = ids_TK.long() // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups_TK)
    torch.testing.assert_close(w_TK.sum(-1), torch.full((32,), 2.5))
