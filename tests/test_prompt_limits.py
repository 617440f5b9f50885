"""Prompt id checks: `int_ids` (the vectorised type check add_request runs) and `ids_error` on arrays and
lists, against a per-id loop."""
import numpy as np
import pytest

from moe_infer.engine.prompt_limits import PromptLimits, int_ids

pytestmark = pytest.mark.timeout(60)

LIMITS = PromptLimits(max_model_len=100, num_kv_blocks=10, block_size=16, max_num_batched_tokens=None, vocab_size=50)


@pytest.mark.parametrize("ids,ok", [
    ([1, 2, 3], True), ((4, 5), True), ([], True), ([True, 2], True), ([np.int64(3), 4], True),
    ([1, 2 ** 70], True),  # an int, out of any vocabulary (ids_error's job)
    ([1, 2.0], False), ([1, "a"], False), ([[1], [2]], False), ([1, None], False), ([np.float32(1)], False),
])
def test_int_ids_accepts_exactly_the_ints(ids, ok):
    assert (int_ids(ids) is not None) == ok
    assert ok == all(isinstance(t, (int, np.integer)) for t in ids)
    if ok:
        assert int_ids(ids).tolist() == [int(t) for t in ids]
        assert all(type(t) is int for t in int_ids(ids).tolist())  # Python ints reach the engine


@pytest.mark.parametrize("ids", [[1, 2, 3], [-1, 60, 3, 49, 50], list(range(-3, 60)), [2 ** 70, 7]])
def test_ids_error_on_an_array_equals_the_list_check(ids):
    bad = [t for t in ids if not 0 <= t < 50]
    for given in (ids, int_ids(ids)):
        err = LIMITS.ids_error(given)
        assert (err is None) == (not bad)
        if bad:
            assert str(bad[:5]) in err
