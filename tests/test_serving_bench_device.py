"""benchmarks/serving.py measures on the machine it runs on: no roofline from another device's figures, and the
offline engine and the server's engine with the same torch thread count on the CPU."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

pytestmark = pytest.mark.timeout(60)


def test_no_roofline_without_a_measured_rate_and_the_rate_it_is_given():
    import serving
    from e2e_generate import TINY

    dims = dict(TINY, vocab_size=6144)
    assert serving.copy_bytes_per_s("cpu") is None
    assert serving.decode_roofline_tok_s(dims, 16, 40, None) is None  # a CPU run printed "(H100 HBM) 39996339 tok/s"
    one = serving.decode_roofline_tok_s(dims, 16, 40, 1e12)
    assert serving.decode_roofline_tok_s(dims, 16, 40, 2e12) == pytest.approx(2 * one)
    assert "no decode roofline" in serving._roofline_text(None, {"device": "cpu"}, 16)


def test_both_sides_get_the_thread_count_the_engine_core_keeps(monkeypatch):
    import serving

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert serving.bench_threads("cpu", [2, 1]) == 6  # the core leaves one core per HTTP process
    assert serving.bench_threads("cpu", [1]) == 7
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert serving.bench_threads("cpu", [2]) == 1
    assert serving.bench_threads("cuda", [1]) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice: both sides, and the core respects it
    assert serving.bench_threads("cpu", [1]) == 3
