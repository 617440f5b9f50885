"""Our decoder on a paged KV cache against transformers' own model on the same weights.

A batch of three sequences of different lengths runs through chunked prefill, a sequence joining
mid-way and several decode steps (block size 4, shuffled blocks, a NaN-filled cache so a read of an
unwritten slot shows); every step's logits must match transformers' logits of the whole sequence.
"""
import pytest
import torch

from moe_infer.models import load_model
from paged_sim import PagedSim, run_schedule
from tiny_hf import load_hf_model, make_tiny_checkpoint

PROMPTS = {0: 9, 1: 6, 2: 3}
SCHEDULE = [
    {0: 9, 1: 4},  # seq 0 prefill, seq 1 first chunk
    {0: 1, 1: 2},  # seq 0 decodes while seq 1 finishes its prefill
    {0: 1, 1: 1, 2: 3},  # seq 2 joins
    {0: 1, 1: 1, 2: 1},
    {0: 1, 1: 1, 2: 1},
    {0: 1, 1: 1, 2: 1},
]

CASES = {
    "mixtral": ("mixtral", {}),
    "mixtral_window": ("mixtral", {"sliding_window": 5}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_tied": ("qwen3_moe", {"tie_word_embeddings": True}),
    "olmoe": ("olmoe", {}),
}


def _tokens(vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = {s: sum(step.get(s, 0) for step in SCHEDULE) for s in PROMPTS}
    return {s: torch.randint(3, vocab, (n,), generator=g).tolist() for s, n in lengths.items()}


def hf_logits(hf, tokens: dict, device="cpu") -> dict:
    with torch.no_grad():
        return {s: hf(torch.tensor([t], device=device)).logits[0].float() for s, t in tokens.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_transformers(case, tmp_path):
    family, overrides = CASES[case]
    path = make_tiny_checkpoint(family, tmp_path / case, seed=3, **overrides)
    model = load_model(path, torch.float32, "cpu")
    tokens = _tokens(model.arch.vocab_size, seed=1)
    ours = run_schedule(PagedSim(model, block_size=4, num_blocks=32, seed=2), tokens, SCHEDULE)
    ref = hf_logits(load_hf_model(path), tokens)
    for s in tokens:
        assert ours[s].shape == ref[s].shape
        assert ref[s].std() > 0.5  # logits are not flat, so the comparison means something
        torch.testing.assert_close(ours[s], ref[s], atol=1e-4, rtol=1e-4, msg=f"{case} seq {s}")


def test_sliding_window_changes_the_output(tmp_path):
    """The window case above is not vacuous: with the window the logits differ from full attention."""
    full = load_model(make_tiny_checkpoint("mixtral", tmp_path / "full", seed=3), torch.float32, "cpu")
    win = load_model(make_tiny_checkpoint("mixtral", tmp_path / "win", seed=3, sliding_window=5), torch.float32, "cpu")
    tokens = _tokens(full.arch.vocab_size, seed=1)
    a = run_schedule(PagedSim(full, block_size=4, num_blocks=32), tokens, SCHEDULE)
    b = run_schedule(PagedSim(win, block_size=4, num_blocks=32), tokens, SCHEDULE)
    assert torch.allclose(a[0][:5], b[0][:5], atol=1e-5)  # inside the window: identical
    assert not torch.allclose(a[0][6:], b[0][6:], atol=1e-2)


def test_block_layout_does_not_matter(tmp_path):
    """Other block sizes and block orders give the same logits."""
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "q3", seed=5)
    model = load_model(path, torch.float32, "cpu")
    tokens = _tokens(model.arch.vocab_size, seed=4)
    a = run_schedule(PagedSim(model, block_size=4, num_blocks=32, seed=0), tokens, SCHEDULE)
    b = run_schedule(PagedSim(model, block_size=3, num_blocks=40, seed=9), tokens, SCHEDULE)
    c = run_schedule(PagedSim(model, block_size=16, num_blocks=4, seed=1), tokens, SCHEDULE)
    for s in tokens:
        torch.testing.assert_close(a[s], b[s], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a[s], c[s], atol=1e-5, rtol=1e-5)
