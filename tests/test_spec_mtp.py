"""Speculative decoding with DeepSeek-V3's MTP layer (moe_infer/engine/speculative/mtp.py) on a tiny checkpoint.

References: the plain engine's greedy tokens (speculation must not change them), and the MTP layer's proposals
computed by hand: transformers' DeepSeek-V3 for the target's final hidden states, the layer's published equations
over transformers' decoder block (as tests/test_mtp.py checks the layer itself), chained on its own output."""
from __future__ import annotations

import pytest
import torch

from moe_infer import LLM, SamplingParams
from test_mtp import _checkpoint_with_mtp, _rms
from tiny_hf import hf_model_class

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [21, 22, 23, 24, 25, 26]]
NUM_NEW = 12


def _params():
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _mtp_reference(block, extra, eps, ids, hidden):
    """(normed hidden states [T, D], logits [T, V]) of the MTP layer over rows 0..T-1 (positions 0..T-1, causal):
    x = eh_proj([enorm(embed(t)) | hnorm(h)]) (position 0's embedding zeroed), transformers' block, shared_head."""
    T = len(ids)
    positions = torch.arange(T)
    e = extra["embed_tokens.weight"][ids] * (positions != 0)[:, None]
    x = torch.cat((_rms(e, extra["enorm.weight"], eps), _rms(hidden, extra["hnorm.weight"], eps)), -1)
    x = x @ extra["eh_proj.weight"].T
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    y = block.model.layers[block.L](x[None], attention_mask=mask, position_ids=positions[None],
                                    position_embeddings=block.model.rotary_emb(x[None], positions[None]))[0]
    y = _rms(y, extra["shared_head.norm.weight"], eps)
    return y, y @ extra["shared_head.head.weight"].T


def _expected_proposals(target, block, extra, tokens, k):
    """The proposals for a sequence of tokens (its last one not yet through the target): the layer over positions
    0..len-2 with the target's hidden states, then chained on its own hidden states, argmax each."""
    eps = target.config.rms_norm_eps
    ids = torch.tensor(tokens)
    hidden = target.model(ids[None, :-1]).last_hidden_state[0]
    row_ids, out = ids[1:], []
    for _ in range(k):
        y, logits = _mtp_reference(block, extra, eps, row_ids, hidden)
        out.append(int(logits[-1].argmax()))
        row_ids = torch.cat((row_ids, torch.tensor([out[-1]])))
        hidden = torch.cat((hidden, y[-1:]))
    return out


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    path, hf, extra, L = _checkpoint_with_mtp(tmp_path_factory.mktemp("spec_mtp"))
    hf.L = L
    return path, hf, extra


def _llm(path, k=None, **kw):
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
    return LLM(model=path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=128,
               speculative_config=spec, **kw)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain_and_proposals_are_the_layers(mtp_checkpoint, k):
    path, block, extra = mtp_checkpoint
    plain = _llm(path)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(),
                                                           use_tqdm=False)]
    llm = _llm(path, k)
    spec = llm.engine.speculator
    seen = []
    propose = spec.propose

    def spy(running):
        propose(running)
        seen.extend((list(s.token_ids), list(s.spec_token_ids)) for s in running if s.spec_token_ids)

    spec.propose = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.engine.get_stats()
    assert stats.num_spec_proposed_tokens > 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    assert len(seen) >= 4
    _, target_cls = hf_model_class("deepseek_v3")
    target = target_cls.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for tokens, proposed in seen:
            assert proposed == _expected_proposals(target, block, extra, tokens, len(proposed)), tokens


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_mtp_on_the_gpu(mtp_checkpoint):
    """On the GPU (float32): the same greedy tokens as the plain engine, verify steps replayed as graphs (which leave
    the LM head out: the MTP layer reads their hidden states), no KV block leaked."""
    path, _, _ = mtp_checkpoint
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kw = dict(model=path, dtype="float32", device="cuda", block_size=4, num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, _params(), use_tqdm=False)]
    llm = LLM(**kw, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    graphs = llm.engine.runner.graphs
    assert graphs is not None and not graphs.with_logits and graphs.max_query_len == 3
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, _params(), use_tqdm=False)] == want
    assert graphs.disabled is None and graphs.verify_runs > 0, (graphs.disabled, graphs.verify_runs)
    stats = llm.engine.get_stats()
    assert stats.num_spec_proposed_tokens > 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
