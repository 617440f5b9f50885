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


def test_record_load_refuses_bad_counters():
    ids_TK, kept_TK, _ = _case(4, 2, 8, seed=1)
    good = [torch.zeros(8, dtype=torch.int64, device=DEVICE) for _ in range(4)]
    with pytest.raises(ValueError, match="routed counters must be contiguous int64"):
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
