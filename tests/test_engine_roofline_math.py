"""benchmarks/engine_roofline.py's rooflines against figures computed independently: issue 17's table
(decode at 3.0 TB/s for the 8-layer Qwen3-30B-A3B shape, prompt 128, 128 new tokens) and a hand count of
one decode step's bytes."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

pytestmark = pytest.mark.timeout(60)


def _dims():
    import e2e_generate

    dims = dict(e2e_generate.REAL)
    dims["num_hidden_layers"] = 8
    return dims


@pytest.mark.parametrize("batch,issue_tok_s", [(1, 1954), (16, 6665), (64, 18048)])
def test_decode_roofline_matches_the_issue(batch, issue_tok_s):
    import engine_roofline as er

    tok_s = batch * 128 / er.decode_roofline_s(_dims(), batch, 128, 128, 3.0e12)
    assert abs(tok_s / issue_tok_s - 1) < 1e-3, tok_s


def test_one_decode_step_by_hand():
    """Batch 1, one step over 10 cached keys: 8 layers x (q, k, v, o projections + router + 8 experts of
    3 x 2048 x 768) + the LM head, bf16, plus 8 x 10 keys x 2 (K and V) x 4 heads x 128."""
    import engine_roofline as er

    attn = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048
    per_layer = 2 * (attn + 2048 * 128 + 8 * 3 * 2048 * 768)
    head = 2 * 151936 * 2048
    kv = 8 * 10 * 2 * 4 * 128 * 2
    assert er.decode_roofline_s(_dims(), 1, 10, 1, 1.0) == pytest.approx(8 * per_layer + head + kv, rel=1e-12)


def test_prefill_limit_is_the_larger_of_compute_and_weights():
    import engine_roofline as er

    dims = _dims()
    fast_compute = er.prefill_limit_s(dims, 1, 1024, 3.0e12, 1e30)  # weights only: every expert touched
    every_expert = 8 * 2 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2048 * 128 + 128 * 3 * 2048 * 768)
    assert fast_compute == pytest.approx((every_expert + 2 * 151936 * 2048) / 3.0e12, rel=1e-3)
    assert er.prefill_limit_s(dims, 1, 1024, 1e30, 1e6) > fast_compute  # compute-bound when FLOPs are slow
