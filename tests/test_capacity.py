"""Capacity policies: `drop` against DeepSpeed's gating, properties of drop / reroute / dropless
(hypothesis), Triton kernels against the PyTorch references, and the load statistics."""
# conftest.py turns the Triton interpreter on when there is no CUDA device (before triton loads).
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import moe_infer.routing.triton_select  # noqa: E402,F401  (registers the Triton backends)
from moe_infer.routing.capacity import CAPACITY_POLICIES, expert_capacity  # noqa: E402
from moe_infer.routing.select import select_experts_torch  # noqa: E402
from moe_infer.routing.spec import RoutingSpec  # noqa: E402
from moe_infer.routing.stats import ExpertLoadStats  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ORDERS = [("position", "token"), ("position", "slot"), ("score", "token")]


def _route(T, E, K, seed, skew=1.0, renormalize=True, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(T, E, generator=gen) * 2 + torch.linspace(0, skew, E)  # later experts more popular
    spec = RoutingSpec(E, K, renormalize=renormalize)
    w_TK, ids_TK = select_experts_torch(logits_TE, spec)
    return logits_TE.to(device), spec, ids_TK.to(device), w_TK.to(device)


def _policy(name, ids, w, logits, spec, cf, min_cap, drop_by="position", order="token", backend="auto"):
    return CAPACITY_POLICIES.get(name)(ids, w, logits_TE=logits, spec=spec, capacity_factor=cf,
                                       min_capacity=min_cap, drop_by=drop_by, position_order=order, backend=backend)


@pytest.mark.parametrize("K", [1, 2, 4, 8])
@pytest.mark.parametrize("drop_by,ds_policy", [("position", "position"), ("score", "probs")])
@pytest.mark.parametrize("cf,min_cap", [(1.0, 4), (0.5, 1), (1.25, 0), (0.25, 12)])
def test_drop_equals_deepspeed_topkgating(K, drop_by, ds_policy, cf, min_cap):
    from deepspeed.moe.sharded_moe import topkgating

    T, E = 48, 16
    logits, spec, ids, w = _route(T, E, K, seed=K * 7 + int(cf * 4), device="cpu")
    out = topkgating(logits.clone(), K, cf, min_cap, drop_tokens=True, drop_policy=ds_policy, sparse_routes=True)
    ds_capacity, ds_ids_KT, ds_gates_KT = int(out[1]), out[3], out[5]
    assert ds_capacity == expert_capacity(T, K, E, cf, min_cap)
    kept_ids, kept_w = _policy("drop", ids, w, logits, spec, cf, min_cap, drop_by, backend="torch")
    assert torch.equal(kept_ids, ds_ids_KT.t().int())
    must_drop = int(torch.bincount(ids.flatten().long()).max()) > ds_capacity
    assert bool((kept_ids < 0).any()) == must_drop
    torch.testing.assert_close(kept_w, ds_gates_KT.t().float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cf,min_cap", [(1.0, 4), (0.5, 1), (0.75, 0)])
def test_drop_slot_order_equals_deepspeed_top2gating(cf, min_cap):
    from deepspeed.moe.sharded_moe import top2gating

    T, E = 40, 8
    logits, spec, ids, w = _route(T, E, 2, seed=11, device="cpu")
    out = top2gating(logits.clone(), cf, min_cap, drop_tokens=True, top2_2nd_expert_sampling=False, sparse_routes=True)
    assert int(out[1]) == expert_capacity(T, 2, E, cf, min_cap)
    kept_ids, kept_w = _policy("drop", ids, w, logits, spec, cf, min_cap, "position", "slot", backend="torch")
    assert torch.equal(kept_ids, out[3].t().int()) and (kept_ids < 0).any()
    torch.testing.assert_close(kept_w, out[5].t().float(), atol=1e-6, rtol=1e-5)


def _assert_drop_properties(ids, w, kept_ids, kept_w, E, capacity, renormalize):
    counts = torch.bincount(kept_ids[kept_ids >= 0].long().cpu(), minlength=E)
    assert int(counts.max()) <= capacity
    assert torch.all((kept_ids == ids) | (kept_ids == -1))
    assert torch.all(kept_w[kept_ids < 0] == 0)
    # an expert drops a row only when it is full
    for e in torch.unique(ids[(kept_ids < 0) & (ids >= 0)]).tolist():
        assert int(counts[e]) == capacity
    if renormalize:
        has_kept = (kept_ids >= 0).any(-1)
        torch.testing.assert_close(kept_w.sum(-1)[has_kept], w.sum(-1)[has_kept], atol=1e-5, rtol=1e-5)


def _assert_reroute_properties(ids, kept_ids, E, capacity):
    kept_ids, ids = kept_ids.cpu(), ids.cpu()
    counts = torch.bincount(kept_ids[kept_ids >= 0].long(), minlength=E)
    assert int(counts.max()) <= capacity
    for t in range(ids.shape[0]):
        row = [e for e in kept_ids[t].tolist() if e >= 0]
        assert len(row) == len(set(row)), "a token uses an expert twice"
        if (kept_ids[t] < 0).any():  # left dropped only if every expert it does not use is full
            assert all(int(counts[e]) == capacity for e in range(E) if e not in row)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 40), E=st.integers(2, 12), K=st.integers(1, 4), cf=st.floats(0.1, 2.0),
       min_cap=st.integers(0, 5), order=st.sampled_from(ORDERS), renorm=st.booleans(), seed=st.integers(0, 999))
def test_no_expert_over_capacity_and_dropless_keeps_all(T, E, K, cf, min_cap, order, renorm, seed):
    K = min(K, E)
    logits, spec, ids, w = _route(T, E, K, seed, skew=3.0, renormalize=renorm)
    capacity = expert_capacity(T, K, E, cf, min_cap)
    backends = ("torch", "triton") if seed % 5 == 0 else ("torch",)
    for backend in backends:
        kept_ids, kept_w = _policy("drop", ids, w, logits, spec, cf, min_cap, *order, backend=backend)
        _assert_drop_properties(ids, w, kept_ids, kept_w, E, capacity, renorm)
        r_ids, r_w = _policy("reroute", ids, w, logits, spec, cf, min_cap, *order, backend=backend)
        _assert_reroute_properties(ids, r_ids, E, capacity)
        assert torch.all(r_w[r_ids < 0] == 0)
    d_ids, d_w = _policy("dropless", ids, w, logits, spec, cf, min_cap)
    assert torch.equal(d_ids, ids) and torch.equal(d_w, w)


CASES = [(6, 1), (6, 4), (8, 2), (8, 8), (60, 4), (128, 8), (256, 8), (256, 2)]


@pytest.mark.parametrize("E,K", CASES)
@pytest.mark.parametrize("policy", ["drop", "reroute"])
def test_triton_capacity_matches_reference_interpreter(E, K, policy):
    for i, (T, cf) in enumerate(((1, 1.0), (17, 0.5), (37, 1.0))):
        logits, spec, ids, w = _route(T, E, K, seed=E + K + i, skew=4.0)
        for drop_by, order in ORDERS:
            ref = _policy(policy, ids, w, logits, spec, cf, 1, drop_by, order, backend="torch")
            out = _policy(policy, ids, w, logits, spec, cf, 1, drop_by, order, backend="triton")
            assert torch.equal(out[0], ref[0]), (drop_by, order)
            torch.testing.assert_close(out[1], ref[1], atol=1e-6, rtol=1e-5)


def test_reroute_moves_to_next_best_expert_with_room():
    # 4 tokens all prefer expert 0 then 1; capacity 2 (cf 0.5 * 4 * 1 / 1... min 2): tokens 2, 3 move to expert 1
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]] * 4, device=DEVICE)
    spec = RoutingSpec(4, 1, renormalize=False)
    w, ids = select_experts_torch(logits, spec)
    for backend in ("torch", "triton"):
        r_ids, r_w = _policy("reroute", ids, w, logits, spec, 0.1, 2, backend=backend)
        assert r_ids.flatten().tolist() == [0, 0, 1, 1]
        torch.testing.assert_close(r_w.flatten(), torch.softmax(logits[0], -1)[[0, 0, 1, 1]])


def test_policy_errors_name_the_problem():
    logits, spec, ids, w = _route(4, 8, 2, seed=0)
    with pytest.raises(ValueError, match="drop_by"):
        _policy("drop", ids, w, logits, spec, 1.0, 1, drop_by="random")
    with pytest.raises(ValueError, match="router logits"):
        CAPACITY_POLICIES.get("reroute")(ids, w, spec=spec)
    with pytest.raises(ValueError, match="capacity_factor"):
        _policy("drop", ids, w, logits, spec, 0.0, 1)
    with pytest.raises(KeyError, match="capacity kernels 'cuda_only'"):
        _policy("drop", ids, w, logits, spec, 1.0, 1, backend="cuda_only")


def test_load_stats_count_routed_dropped_rerouted():
    logits, spec, ids, w = _route(30, 8, 2, seed=5, skew=4.0)
    stats = ExpertLoadStats(2, 8, DEVICE)
    kept, _ = _policy("drop", ids, w, logits, spec, 0.5, 1)
    moved, _ = _policy("reroute", ids, w, logits, spec, 0.5, 1)
    stats.record(0, ids, kept)
    stats.record(1, ids, moved)
    s = stats.summary()
    assert sum(s[0]["routed"]) == 60 and sum(s[0]["dropped"]) == int((kept < 0).sum()) > 0
    assert sum(s[1]["rerouted"]) == int(((moved >= 0) & (moved != ids)).sum()) > 0
    assert s[0]["imbalance"] == pytest.approx(max(s[0]["routed"]) / 7.5)
    assert float(stats.imbalance_L()[0]) == pytest.approx(s[0]["imbalance"])
    stats.reset()
    assert stats.summary()[0]["routed"] == [0] * 8


@pytest.mark.gpu
@pytest.mark.parametrize("E,K", CASES)
def test_triton_capacity_full_shapes_gpu(E, K):
    for T, cf in ((1, 1.0), (1000, 0.75), (4096, 1.25)):
        logits, spec, ids, w = _route(T, E, K, seed=E * K + T, skew=4.0)
        for drop_by, order in ORDERS:
            ref = _policy("drop", ids, w, logits, spec, cf, 4, drop_by, order, backend="torch")
            out = _policy("drop", ids, w, logits, spec, cf, 4, drop_by, order, backend="triton")
            assert torch.equal(out[0], ref[0])
            torch.testing.assert_close(out[1], ref[1], atol=1e-6, rtol=1e-5)
        if T <= 1000:  # the reference reroute is a host loop
            ref = _policy("reroute", ids, w, logits, spec, cf, 4, backend="torch")
            out = _policy("reroute", ids, w, logits, spec, cf, 4, backend="triton")
            assert torch.equal(out[0], ref[0])


def test_moe_layer_with_drop_policy_skips_dropped_rows():
    from moe_infer.experts.local_dispatch import LocalDispatcher
    from moe_infer.experts.reference import experts_torch
    from moe_infer.layers.moe import MoEBackends, MoELayer

    torch.manual_seed(0)
    T, D, F_, E, K = 24, 8, 6, 4, 2
    spec = RoutingSpec(E, K)
    kwargs = dict(capacity_factor=0.5, min_capacity=1, drop_by="position")
    stats = ExpertLoadStats(1, E, "cpu")
    layer = MoELayer(0, D, F_, spec, MoEBackends(policy="drop", policy_kwargs=kwargs, stats=stats), torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x_TD = torch.randn(T, D)
    with torch.no_grad():
        out_TD = layer(x_TD)
        logits = layer.gate(x_TD)
        w, ids = select_experts_torch(logits, spec)
        kept_ids, kept_w = CAPACITY_POLICIES.get("drop")(ids, w, logits_TE=logits, spec=spec, **kwargs)
        disp = LocalDispatcher(E, permute_backend="torch")
        x_RD, meta = disp.dispatch(x_TD, kept_ids, kept_w)
        ref_TD = disp.combine(experts_torch(x_RD, meta, layer.store.w13_E2FD, layer.store.w2_EDF), meta)
    assert int((kept_ids < 0).sum()) > 0
    torch.testing.assert_close(out_TD, ref_TD)
    assert sum(stats.summary()[0]["dropped"]) == int((kept_ids < 0).sum())
