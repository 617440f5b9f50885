"""SamplingParams validation and the vectorised sampler (statistical where it must be)."""
from __future__ import annotations

import math

import pytest
import torch

from moe_infer.engine.sampler import SampleRequest, Sampler
from moe_infer.engine.sampling_params import SamplingParams

V = 8
EOS = 2
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005])
LOGITS = PROBS.log()


def sampler(seed=0):
    return Sampler(V, [EOS], torch.device("cpu"), seed=seed)


def reqs(n, first_id=0, num_prompt=3, num_out=0, history=None, **kw):
    p = SamplingParams(**kw)
    return [SampleRequest(first_id + i, p, num_prompt, num_out, history) for i in range(n)]


def draw(n=4000, **kw):
    out = sampler()(LOGITS.repeat(n, 1), reqs(n, **kw))
    return torch.bincount(torch.tensor(out.token_ids), minlength=V).float() / n


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(n=0), "n must be an int >= 1"),
    (dict(max_tokens=0), "max_tokens"), (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed=1.5), "seed"),
])
def test_bad_params_raise_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
INTS = ("n", "top_k", "min_tokens", "seed", "max_tokens", "logprobs")


@pytest.mark.parametrize("name, value", [(f, v) for f in FLOATS
                                         for v in (math.nan, math.inf, -math.inf, "1", True, None)]
                         + [(f, v) for f in INTS for v in (1.5, 2.0, "10", True, False)]
                         + [(f, v) for f in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
                            for v in (1, "yes", None)]
                         + [("stop", 5), ("stop", b"x"), ("stop_token_ids", 3), ("stop_token_ids", [True]),
                            ("stop_token_ids", [2.0])])
def test_wrong_types_and_non_finite_numbers_raise_naming_the_field(name, value):
    """nan compares false to every bound (temperature=nan sampled nothing: empty text); max_tokens=1.5, "10",
    stop=5 were taken, or failed later with a bare TypeError."""
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} must be"):
        SamplingParams(**{name: value})


def test_numpy_scalars_are_taken_as_python_numbers():
    import numpy as np

    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), max_tokens=np.int32(4), seed=np.int64(7),
                       stop_token_ids=[np.int64(2)])
    assert (p.temperature, p.top_k, p.max_tokens, p.seed, p.stop_token_ids) == (0.5, 3, 4, 7, [2])
    assert type(p.top_k) is int and type(p.temperature) is float and type(p.stop_token_ids[0]) is int


def test_stop_string_normalised():
    assert SamplingParams(stop="\n").stop_strings == ["\n"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]


def test_greedy_and_temperature_to_zero():
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(0))
    greedy = sampler()(logits, reqs(64, temperature=0.0)).token_ids
    assert greedy == logits.argmax(-1).tolist()
    cold = sampler()(logits, reqs(64, temperature=1e-3)).token_ids
    assert cold == greedy


def test_greedy_batch_is_one_argmax_in_the_model_dtype():
    """An all-greedy batch without logprobs, penalties or min_tokens bans takes the argmax of the logits as
    they come (bf16 from the LM head); anything else goes through the float32 path."""
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert sampler()(logits, reqs(64, temperature=0.0)).token_ids == logits.float().argmax(-1).tolist()
    assert Sampler.argmax_only(reqs(2, temperature=0.0))
    with_lp = sampler()(logits[:2], reqs(2, temperature=0.0, logprobs=1))
    assert all(lp is not None for lp in with_lp.logprobs)
    # a repetition penalty moves the greedy choice off the raw argmax
    raw = torch.tensor([[3.0, 2.5, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]]).to(torch.bfloat16)
    r = SampleRequest(0, SamplingParams(temperature=0.0, repetition_penalty=2.0), 1, 1, [5, 0])
    assert not Sampler.argmax_only([r]) and sampler()(raw, [r]).token_ids == [1]


def test_temperature_one_follows_the_distribution():
    freq = draw(n=20000, temperature=1.0)
    assert (freq - PROBS).abs().max() < 0.015, freq


def test_top_k_only_the_k_best():
    freq = draw(temperature=1.0, top_k=3)
    assert freq[3:].sum() == 0 and (freq[:3] > 0).all()
    torch.testing.assert_close(freq[:3], PROBS[:3] / PROBS[:3].sum(), atol=0.03, rtol=0)


def test_top_p_never_outside_the_nucleus():
    freq = draw(temperature=1.0, top_p=0.6)  # 0.40 < 0.6 <= 0.65: nucleus = tokens {0, 1}
    assert freq[2:].sum() == 0 and (freq[:2] > 0).all()
    torch.testing.assert_close(freq[:2], PROBS[:2] / PROBS[:2].sum(), atol=0.03, rtol=0)
    assert draw(temperature=1.0, top_p=0.4)[1:].sum() == 0  # the top token alone reaches 0.4


def test_top_k_above_the_vocabulary_keeps_every_token():
    """A top_k larger than the vocabulary (the server allows any) is every token; past int64 it once made the step
    fail (schemathesis found it)."""
    for k in (V + 5, 2**64):
        out = sampler(seed=3)(LOGITS.repeat(64, 1), reqs(64, temperature=1.0, top_k=k, seed=5))
        assert out.token_ids == sampler(seed=3)(LOGITS.repeat(64, 1), reqs(64, temperature=1.0, seed=5)).token_ids


def test_top_k_then_top_p_and_min_p():
    freq = draw(temperature=1.0, top_k=2, top_p=0.5)  # renormalised top-2: 0.615, 0.385 -> token 0 only
    assert freq[0] == 1.0
    freq = draw(temperature=1.0, min_p=0.3)  # p >= 0.12 -> tokens {0, 1, 2}
    assert freq[3:].sum() == 0 and (freq[:3] > 0).all()


def test_mixed_batch_rows_keep_their_own_params():
    n = 300
    rs = reqs(n, temperature=0.0) + reqs(n, first_id=n, temperature=1.0, top_k=2)
    out = sampler()(LOGITS.repeat(2 * n, 1), rs).token_ids
    assert set(out[:n]) == {0} and set(out[n:]) == {0, 1}


def test_seed_reproduces_alone_and_inside_a_batch():
    p = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    alone, batched = sampler(seed=0), sampler(seed=99)
    tokens_alone, tokens_batched = [], []
    noise = torch.Generator().manual_seed(5)
    for _ in range(50):  # one sequence (id 7) over 50 steps, the other rows change every step
        tokens_alone.append(alone(logits, [SampleRequest(7, p, 3, 0)]).token_ids[0])
        others = torch.randn(5, V, generator=noise)
        batch_reqs = reqs(2, first_id=100, temperature=1.0) + [SampleRequest(7, p, 3, 0)] + reqs(3, first_id=200, temperature=1.0)
        batch_logits = torch.cat([others[:2], logits, others[2:]])
        tokens_batched.append(batched(batch_logits, batch_reqs).token_ids[2])
    assert tokens_alone == tokens_batched
    assert len(set(tokens_alone)) > 1  # it really sampled
    other = sampler()
    diff = [other(logits, [SampleRequest(7, SamplingParams(temperature=1.0, seed=4321), 3, 0)]).token_ids[0]
            for _ in range(50)]
    assert diff != tokens_alone
    alone.forget([7])
    assert 7 not in alone._seeded


def test_penalties_change_logits_as_defined():
    s = sampler()
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, 0.25]])
    history = [0, 1, 5, 3, 3, 6]  # prompt [0, 1, 5], outputs [3, 3, 6]
    r = SampleRequest(0, SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), 3, 3, history)
    got = s._apply_penalties(logits, [r])[0]
    want = logits[0].clone()
    for t in {0, 1, 5, 3, 6}:  # repetition: prompt and output tokens; positive / p, negative * p
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    want[3] -= 0.5 + 2 * 0.25  # presence once, frequency per occurrence (outputs only)
    want[6] -= 0.5 + 0.25
    torch.testing.assert_close(got, want)
    untouched = SampleRequest(1, SamplingParams(), 3, 3, None)
    both = s._apply_penalties(logits.repeat(2, 1), [untouched, r])
    torch.testing.assert_close(both[0], logits[0])
    torch.testing.assert_close(both[1], want)


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.full((1, V), -5.0)
    logits[0, EOS] = 5.0
    logits[0, 4] = 4.0
    logits[0, 6] = 3.0
    r = SampleRequest(0, SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]), 3, 1)
    assert sampler()(logits, [r]).token_ids == [6]
    r_done = SampleRequest(0, SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]), 3, 2)
    assert sampler()(logits, [r_done]).token_ids == [EOS]


def test_logprobs_are_raw_log_softmax_with_rank():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    rs = [SampleRequest(0, SamplingParams(temperature=0.0, logprobs=3), 1, 0),
          SampleRequest(1, SamplingParams(temperature=5.0, top_k=2, logprobs=0, seed=1), 1, 0),
          SampleRequest(2, SamplingParams(temperature=0.0), 1, 0)]
    out = sampler()(logits, rs)
    ref = logits.log_softmax(-1)
    chosen, rank, top_ids, top_vals = out.logprobs[0]
    assert rank == 1 and math.isclose(chosen, ref[0].max().item(), rel_tol=1e-6)
    assert top_ids == ref[0].topk(3).indices.tolist()
    torch.testing.assert_close(torch.tensor(top_vals), ref[0].topk(3).values)
    chosen, rank, top_ids, _ = out.logprobs[1]
    t = out.token_ids[1]
    assert top_ids == [] and math.isclose(chosen, ref[1, t].item(), rel_tol=1e-6)
    assert rank == int((ref[1] > ref[1, t]).sum()) + 1
    assert out.logprobs[2] is None


def filtered_distribution(logits, temperature, top_k=-1, top_p=1.0, min_p=0.0):
    """Naive reference: softmax(logits / T), then top-k, then top-p of the renormalised top-k set
    (the top token always stays), then min-p against the most likely token; renormalised."""
    z = [x / temperature for x in logits.tolist()]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    p = [x / sum(e) for x in e]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = order[:top_k] if top_k != -1 else order
    mass, nucleus = sum(p[i] for i in keep), []
    for i in keep:
        if nucleus and sum(p[j] for j in nucleus) / mass >= top_p:
            break
        nucleus.append(i)
    kept = [i for i in nucleus if p[i] >= min_p * p[order[0]]]
    out = torch.zeros(len(p))
    for i in kept:
        out[i] = p[i] / sum(p[j] for j in kept)
    return out


@pytest.mark.parametrize("temperature, kw", [
    (2.0, dict(top_p=0.6)),  # flatter: the nucleus is {0, 1, 2, 3} (at T=1 it is {0, 1})
    (0.5, dict(min_p=0.1)),  # sharper: p >= 0.1 p_max keeps {0, 1, 2} (at T=1 {0, 1, 2, 3, 4})
    (0.5, dict(top_p=0.8)),  # sharper: {0, 1} (at T=1 {0, 1, 2, 3})
    (3.0, dict(top_k=5, top_p=0.7, min_p=0.4)),
])
def test_filters_apply_to_the_tempered_distribution(temperature, kw):
    want = filtered_distribution(LOGITS, temperature, **kw)
    freq = draw(n=20000, temperature=temperature, **kw)
    assert torch.equal(freq > 0, want > 0), (freq, want)  # the same support, no token outside it
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["late_sample", "freed_before_the_copy"])
def test_sampled_tokens_copy_on_the_side_stream_gpu(case):
    """On CUDA the tokens' copy to the host runs on a side stream. late_sample: the sample is launched behind ~5 ms
    of compute-stream work and the side stream is idle: the copy must wait for it. freed_before_the_copy: the copy
    is held back ~10 ms on the side stream while the tokens are freed and a same-sized block is allocated and
    overwritten on the compute stream: the allocator must not hand out the tokens' memory before the copy read it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moe_infer.engine.sampler import SampledTokens, _copy_stream

    dev = torch.device("cuda")
    side = _copy_stream(dev)
    assert side is not None and side != torch.cuda.current_stream(dev) and _copy_stream(torch.device("cuda", 0)) is side
    B = 257  # a block size no other tensor here has
    logits_cpu = torch.randn(B, 4096)
    want = logits_cpu.argmax(-1).tolist()
    logits = logits_cpu.to(dev)
    # a first pinned block of this size is allocated by cudaHostAlloc, which waits for the device: one sample
    # first, as in the engine's steady state, leaves one in the host allocator's cache
    warm = SampledTokens((-logits).argmax(-1), None, [None] * B)  # other tokens: its freed block holds no answer
    assert warm.result().token_ids == logits_cpu.argmin(-1).tolist()
    del warm
    torch.cuda.synchronize()
    if case == "late_sample":
        torch.cuda._sleep(10_000_000)
    else:
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
    tokens = logits.argmax(-1)
    sampled = SampledTokens(tokens, None, [None] * B)
    if case == "freed_before_the_copy":
        active = torch.cuda.memory_stats(dev)["active_bytes.all.current"]
        del tokens
        sampled.token_ids_B = None
        # the block stays active (not free for reuse) until the copy stream's work up to the copy has run
        assert torch.cuda.memory_stats(dev)["active_bytes.all.current"] == active
        junk = torch.empty(B, dtype=torch.int64, device=dev)
        junk.fill_(-7)  # were the block free, this could be it
    assert sampled.result().token_ids == want
