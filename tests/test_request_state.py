"""A request's RequestOutput metrics from its sequences' timestamps, computed here by hand (n = 1 takes
a shorter path than n > 1: both are checked), and the prompt ids an output carries."""
from __future__ import annotations

import pytest

from moe_infer.engine.request_state import RequestState
from moe_infer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)


def with_times(seq, arrival, first, last, finished, num_out, preempted=0, cached=0):
    m = seq.metrics
    m.arrival_time, m.first_token_time, m.last_token_time, m.finished_time = arrival, first, last, finished
    m.num_preemptions = preempted
    seq.num_cached_tokens = cached
    for t in range(num_out):
        seq.append_token(100 + t)


def test_one_sample_metrics():
    req = RequestState("a", "p", [1, 2, 3], SamplingParams(max_tokens=8))
    seq = req.children[0].seq
    m = req.output().metrics
    assert (m.time_to_first_token, m.time_per_output_token, m.e2e_latency) == (None, None, None)
    with_times(seq, arrival=10.0, first=10.5, last=11.5, finished=None, num_out=5, preempted=2, cached=16)
    m = req.output().metrics
    assert m.arrival_time == 10.0 and m.time_to_first_token == pytest.approx(0.5)
    assert m.time_per_output_token == pytest.approx(1.0 / 4) and m.e2e_latency is None
    assert (m.num_preemptions, m.num_cached_prompt_tokens) == (2, 16)
    seq.metrics.finished_time = 12.0
    assert req.output().metrics.e2e_latency == pytest.approx(2.0)
    seq.metrics.last_token_time, seq.token_ids[:] = 10.5, seq.token_ids[:4]  # one output token: no TPOT
    assert req.output().metrics.time_per_output_token is None


def test_parallel_samples_metrics():
    req = RequestState("b", "p", [1, 2, 3], SamplingParams(max_tokens=8, n=2))
    a, b = (c.seq for c in req.children)
    with_times(a, 10.0, 10.6, 11.6, 12.0, num_out=3, preempted=1, cached=0)
    with_times(b, 10.0, 10.4, 10.8, None, num_out=5, preempted=1, cached=16)
    m = req.output().metrics
    assert m.time_to_first_token == pytest.approx(0.4)  # the first token of any sample
    assert m.time_per_output_token == pytest.approx((1.0 / 2 + 0.4 / 4) / 2)  # the mean over samples
    assert m.e2e_latency is None  # not every sample has finished
    b.metrics.finished_time = 12.5
    assert req.output().metrics.e2e_latency == pytest.approx(2.5)
    assert (m.num_preemptions, m.num_cached_prompt_tokens) == (2, 16)


def test_outputs_carry_the_prompt_ids():
    req = RequestState("c", "p", [4, 5, 6], SamplingParams(max_tokens=8))
    req.children[0].seq.append_token(7)
    first, second = req.output(), req.output()
    assert first.prompt_token_ids == second.prompt_token_ids == [4, 5, 6]
    assert first.outputs[0].token_ids == [7]


def test_prompt_ids_as_an_array_reach_the_sequences():
    """add_request hands over the int64 array its id check made: every sample's sequence keeps it (prompt chunks
    are planned from it) and holds the ids as a list of Python ints; any other array is refused."""
    import numpy as np

    from moe_infer import LLM
    from moe_infer.assets import TINY_MOE_DIR

    prompt_N = np.array([5, 6, 7, 2 ** 40], dtype=np.int64)
    req = RequestState("d", None, prompt_N, SamplingParams(max_tokens=8, n=2))
    for seq in req.seqs:
        assert seq.prompt_array is prompt_N and seq.token_ids == [5, 6, 7, 2 ** 40]
        assert all(type(t) is int for t in seq.token_ids)
    assert req.output().prompt_token_ids == [5, 6, 7, 2 ** 40]
    with pytest.raises(ValueError, match="int64"):
        RequestState("e", None, prompt_N.astype(np.int32), SamplingParams())
    engine = LLM(model=str(TINY_MOE_DIR), device="cpu", num_kv_blocks=16).engine
    rid = engine.add_request({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=2))
    seq = engine.requests[rid].seqs[0]
    assert seq.prompt_array.tolist() == [3, 4, 5] and seq.token_ids == [3, 4, 5]
