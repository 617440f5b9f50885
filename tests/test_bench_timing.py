"""The benchmarks' CUDA-graph timer (moe_infer/kernels/fused_moe_bench.py): its sustained-load option replays first."""
import time

import pytest
import torch

from moe_infer.kernels.fused_moe_bench import graph_time_us


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_sustained_timing_replays_for_its_time_first():
    count = torch.zeros((), dtype=torch.int64, device="cuda")
    x = torch.randn(256, 256, device="cuda")

    def fn():
        count.add_(1)  # counts every run: the eager ones and each graph replay
        return x @ x

    assert graph_time_us(fn, num_replays=5, warmup=1) > 0
    plain = int(count.item())
    assert plain == 2 + 1 + 5  # fn() and its side-stream run before the capture, the warm-up, the timed replays
    count.zero_()
    t0 = time.perf_counter()
    assert graph_time_us(fn, num_replays=5, warmup=1, sustain_s=0.25) > 0
    sustained_s, sustained = time.perf_counter() - t0, int(count.item())
    assert sustained_s >= 0.25
    assert sustained > plain + 4  # replayed while the 0.25 s lasted, before the timed replays
