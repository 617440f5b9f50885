"""Rooflines come from the device's own measured rates (benchmarks/device_rates.py), not from fixed H100 figures."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from device_rates import measure_rates  # noqa: E402

from moe_infer.kernels.fused_moe_bench import roofline_us  # noqa: E402


def test_expert_roofline_divides_by_the_rates_it_is_given():
    ids_TK = torch.tensor([[0, 1], [1, 2]])  # 3 distinct experts, 4 routed rows
    E, D, F = 4, 64, 32
    mem_bound = roofline_us(ids_TK, E, D, F, hbm_bytes_per_s=1e9, flops_per_s=1e30)
    assert mem_bound == pytest.approx(3 * 3 * D * F * 2 / 1e9 * 1e6)
    assert roofline_us(ids_TK, E, D, F, hbm_bytes_per_s=2e9, flops_per_s=1e30) == pytest.approx(mem_bound / 2)
    flop_bound = roofline_us(ids_TK, E, D, F, hbm_bytes_per_s=1e30, flops_per_s=1e9)
    assert flop_bound == pytest.approx(2 * 4 * 3 * D * F / 1e9 * 1e6)


def test_cpu_rates_say_they_are_nominal():
    rates = measure_rates("cpu")
    assert "nominal" in rates["note"] and rates["hbm_gbps"] > 0 and rates["tflops"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_rates_are_measured():
    rates = measure_rates("cuda")
    # Any datacenter GPU of the last years: a copy of hundreds of GB/s to a few TB/s, tens to thousands of TFLOP/s.
    assert 100 < rates["hbm_gbps"] < 20_000, rates
    assert 5 < rates["tflops"] < 5_000, rates
    assert "note" not in rates and rates["gpu"] == torch.cuda.get_device_name()
