"""scripts/tune_fused_moe.py on CPU: shapes named or given as E:K:D:F, and the candidate lists of its options."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tuner():
    spec = importlib.util.spec_from_file_location("tune_fused_moe", os.path.join(ROOT, "scripts", "tune_fused_moe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shapes_by_name_or_numbers_and_a_clear_error():
    tuner = _tuner()
    assert tuner.parse_shape("qwen3-30b-a3b") == (128, 8, 2048, 768)
    assert tuner.parse_shape("60:4:2048:1408") == (60, 4, 2048, 1408)
    for bad in ("qwen3", "60:4:2048", "60:0:2048:1408", "a:b:c:d"):
        with pytest.raises(SystemExit, match="E:K:D:F"):
            tuner.parse_shape(bad)


def test_candidates_of_the_options():
    tuner = _tuner()
    cands = tuner.GATE_UP[128]
    plain = list(tuner.candidates(cands, 128, persistent=False))
    assert len(plain) == len(cands) and not any(c.persistent or c.one_dot for c in plain)
    both = list(tuner.candidates(cands, 128, persistent=True, one_dot=True))
    assert len(both) == 6 * len(cands)  # plain and one dot, each as tiles, persistent, persistent flattened
    assert all(c.use_tma for c in both if c.one_dot)
    assert {(c.persistent, c.flatten) for c in both} == {(False, True), (True, False), (True, True)}
    decode = list(tuner.candidates(tuner.GATE_UP[16], 16, persistent=True))  # decode tiles: never persistent
    assert not any(c.persistent for c in decode)
