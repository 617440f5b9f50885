"""The rates a roofline divides by, measured on the device the benchmark runs on (never another device's figures).

    rates = measure_rates(torch.device("cuda"))   # {"hbm_gbps", "tflops", "gpu"}

hbm_gbps: bytes read + written per second by a 1 GiB device-to-device copy; tflops: a dense 8192^3 bf16 GEMM.
Each is the median of 20 calls timed between CUDA events, after 3 warm-up calls. On a CPU the figures are nominal
(`note` says so) and a roofline computed from them means nothing.
"""
from __future__ import annotations

import statistics

import torch

GEMM_N = 8192


def _median_s(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_rates(device: torch.device | str) -> dict:
    """HBM copy GB/s (read + write) and dense bf16 TFLOP/s of `device`, measured now."""
    device = torch.device(device)
    if device.type != "cuda":
        return dict(hbm_gbps=50.0, tflops=1.0, gpu="cpu", note="CPU: nominal rates, the rooflines mean nothing here")
    with torch.cuda.device(device):
        n = 1 << 30
        src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
        copy_s = _median_s(lambda: dst.copy_(src))
        x = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device)
        gemm_s = _median_s(lambda: x @ x)
    return dict(hbm_gbps=2 * n / copy_s / 1e9, tflops=2 * GEMM_N ** 3 / gemm_s / 1e12,
                gpu=torch.cuda.get_device_name(device))
