"""The one-launch expert-load counts (`moe_infer.kernels.expert_load`) against a naive per-row loop: routed,
processed, dropped and rerouted per expert, with and without a capacity policy's kept ids and a padding mask,
over more rows than one program takes (interpreter on CPU, CUDA with -m gpu); and `ExpertLoadStats.record`
takes the kernel on CUDA.

Legend: T tokens, K top-k, E experts.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moe_infer.kernels.expert_load import BLOCK, record_load_triton  # noqa: E402
from moe_infer.routing.stats import ExpertLoadStats  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(120)


def _naive(ids_TK, kept_TK, valid_T, E):
    """Per row: routed[e] (+ dropped[e] if its kept id is -1, + rerouted[e] if another), processed[kept id]."""
    routed, processed, dropped, rerouted = ([0] * E for _ in range(4))
    for t, row in enumerate(ids_TK.tolist()):
        if valid_T is not None and not bool(valid_T[t]):
            continue
        kept_row = kept_TK[t].tolist() if kept_TK is not None else row
        for e, k in zip(row, kept_row):
            routed[e] += 1
            if k < 0:
                dropped[e] += 1
            else:
                processed[k] += 1
                rerouted[e] += k != e
    return routed, processed, dropped, rerouted


def _case(T, K, E, seed):
    g = torch.Generator().manual_seed(seed)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    kept_TK = ids_TK.clone()
    r = torch.rand(T, K, generator=g)
    kept_TK[r < 0.2] = -1  # dropped
    moved = r > 0.8
    kept_TK[moved] = torch.randint(0, E, (int(moved.sum()),), generator=g, dtype=torch.int32)  # rerouted (or not)
    valid_T = torch.rand(T, generator=g) > 0.25
    return ids_TK.to(DEVICE), kept_TK.to(DEVICE), valid_T.to(DEVICE)


# N = T * K <= E: an atomic per row (the first three); histograms in 2 programs (the last)
@pytest.mark.parametrize("T,K,E", [(1, 8, 128), (3, 2, 8), (16, 8, 128), (BLOCK // 2 + 37, 2, 16)])
@pytest.mark.parametrize("with_kept", [False, True])
@pytest.mark.parametrize("with_valid", [False, True])
def test_counts_match_a_per_row_loop(T, K, E, with_kept, with_valid):
    ids_TK, kept_TK, valid_T = _case(T, K, E, seed=T * E + K)
    kept = kept_TK if with_kept else None
    valid = valid_T if with_valid else None
    counters = [torch.full((E,), 5, dtype=torch.int64, device=DEVICE) for _ in range(4)]  # adds to what is there
    record_load_triton(*counters, ids_TK, kept, valid)
    want = _naive(ids_TK.cpu(), kept.cpu() if kept is not None else None, valid.cpu() if valid is not None else None, E)
    for name, got, ref in zip(("routed", "processed", "dropped", "rerouted"), counters, want):
        assert got.tolist() == [5 + r for r in ref], name
    if with_kept:
        assert sum(want[2]) > 0 and sum(want[3]) > 0 or T < 5  # the case drops and reroutes rows


@pytest.mark.parametrize("T,K,E", [(1, 8, 128), (BLOCK // 2 + 37, 2, 16)])
@pytest.mark.parametrize("with_kept,with_valid", [(False, False), (True, True)])
def test_several_layers_in_one_launch(T, K, E, with_kept, with_valid):
    """ids [n, T, K] into every other row of [L, E] counters (a strided view): each entry counts into its own
    row, equal to the per-row loop, and the rows between stay as they were."""
    n, L = 3, 7
    cases = [_case(T, K, E, seed=T + i) for i in range(n)]
    valid = cases[0][2] if with_valid else None
    ids_nTK = torch.stack([c[0] for c in cases])
    kept_nTK = torch.stack([c[1] for c in cases]) if with_kept else None
    counters = [torch.full((L, E), 5, dtype=torch.int64, device=DEVICE) for _ in range(4)]
    record_load_triton(*[c[1:1 + 2 * n:2] for c in counters], ids_nTK, kept_nTK, valid)
    for i in range(n):
        want = _naive(ids_nTK[i].cpu(), kept_nTK[i].cpu() if with_kept else None,
                      valid.cpu() if valid is not None else None, E)
        for name, got, ref in zip(("routed", "processed", "dropped", "rerouted"), counters, want):
            assert got[1 + 2 * i].tolist() == [5 + r for r in ref], (name, i)
    for row in (0, 2, 4, 6):
        assert all(bool((c[row] == 5).all()) for c in counters), row


def test_deferred_layers_count_as_recorded_ones():
    """ExpertLoadStats.defer + flush (runs of layers, a different padding mask, a layer out of step) equal
    record per layer (on CUDA the runs take the several-layer launch)."""
    E, T, K = 16, 5, 2
    cases = [_case(T, K, E, seed=s) for s in range(6)]
    other_valid = cases[5][2]
    calls = [(0, cases[0], False, True), (2, cases[1], False, True), (4, cases[2], False, True),  # one run
             (5, cases[3], True, True), (6, cases[4], True, True),  # kept ids: a run of their own
             (7, cases[5], True, False)]  # another mask
    got, want = ExpertLoadStats(8, E, DEVICE), ExpertLoadStats(8, E, DEVICE)
    for layer, (ids, kept, valid), use_kept, own_mask in calls:
        mask = cases[0][2] if own_mask else other_valid
        got.defer(layer, ids, kept if use_kept else ids, mask)
        want.record_torch(layer, ids, kept if use_kept else None, mask)
    assert got.routed_LE.sum() == 0  # nothing counted before the flush
    got.flush()
    for name in ("routed_LE", "processed_LE", "dropped_LE", "rerouted_LE"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    got.flush()  # nothing held twice
    assert torch.equal(got.routed_LE, want.routed_LE)


@pytest.mark.gpu
def test_deferred_layers_take_one_launch_a_run_gpu():
    """On CUDA, flush launches the count kernel once per run of deferred layers (3 runs here), equal to the
    torch path."""
    import moe_infer.routing.load_count_triton  # noqa: F401  (registers the kernel)

    E, T, K = 128, 1, 8
    cases = [_case(T, K, E, seed=s) for s in range(6)]
    got, want = ExpertLoadStats(8, E, DEVICE), ExpertLoadStats(8, E, DEVICE)
    valid = cases[0][2]
    for layer, (ids, kept, _), use_kept in zip((0, 1, 2, 3, 5, 6), cases, (False,) * 4 + (True, True)):
        got.defer(layer, ids, kept if use_kept else ids, valid)
        want.record_torch(layer, ids, kept if use_kept else None, valid)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got.flush()
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events() if "expert_load_kernel" in e.name]
    assert len(launches) == 2, launches  # layers 0-3 (no kept ids), layers 5-6 (kept ids)
    for name in ("routed_LE", "processed_LE", "dropped_LE", "rerouted_LE"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_record_load_refuses_bad_counters():
    ids_TK, kept_TK, _ = _case(4, 2, 8, seed=1)
    good = [torch.zeros(8, dtype=torch.int64, device=DEVICE) for _ in range(4)]
    with pytest.raises(ValueError, match="routed counters must be int64"):
        record_load_triton(torch.zeros(8, dtype=torch.int32, device=DEVICE), *good[1:], ids_TK, None, None)
    with pytest.raises(ValueError, match="kept ids"):
        record_load_triton(*good, ids_TK, kept_TK[:2], None)
    with pytest.raises(ValueError, match="padding mask"):
        record_load_triton(*good, ids_TK, None, torch.ones(3, dtype=torch.bool, device=DEVICE))


@pytest.mark.gpu
def test_stats_record_takes_the_kernel_on_cuda_gpu():
    """On CUDA, ExpertLoadStats.record counts in one launch, equal to its torch path."""
    import moe_infer.routing.load_count_triton  # noqa: F401  (registers the kernel)

    ids_TK, kept_TK, valid_T = _case(300, 8, 128, seed=3)
    fast, ref = ExpertLoadStats(2, 128, DEVICE), ExpertLoadStats(2, 128, DEVICE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fast.record(1, ids_TK, kept_TK, valid_T)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("expert_load_kernel" in k for k in kernels) and not any("scatter" in k for k in kernels), kernels
    ref.record_torch(1, ids_TK, kept_TK, valid_T)
    fast.record(0, ids_TK, None, valid_T)
    ref.record_torch(0, ids_TK, None, valid_T)
    for name in ("routed_LE", "processed_LE", "dropped_LE", "rerouted_LE"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
