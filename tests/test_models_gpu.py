"""GPU parity of the decoder with transformers (run on the lent H100/H200; skipped without CUDA).

fp32 on CUDA: the CPU test's check with a looser atol (GPU GEMMs sum in another order).
bf16: one bf16 rounding of the weights and every activation moves logits by ~1e-2 and, in a random
tiny MoE, flips near-tied router choices, which moves some logits by O(1) in transformers' own bf16
model too (measured on CPU: transformers bf16 vs fp32 max error up to 3.4, mean 0.02-0.17). A fixed
atol would either hide bugs or fail on flips, so the bound is relative to transformers' own bf16
error against the fp32 oracle: our mean absolute error may be at most 1.5x transformers' + 0.01 (a
real bug, e.g. a skipped norm or a wrong rotary, gives errors of the logits' scale, ~1.5), and our
greedy tokens must agree with fp32's at least as often as transformers' bf16 tokens do, less 10%.
"""
import pytest
import torch

from moe_infer.models import load_model
from paged_sim import PagedSim, run_schedule
from test_models_parity import CASES, SCHEDULE, _tokens, hf_logits
from tiny_hf import load_hf_model, make_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_cuda_matches_transformers(case, tmp_path):
    family, overrides = CASES[case]
    path = make_tiny_checkpoint(family, tmp_path / case, seed=3, **overrides)
    model = load_model(path, torch.float32, "cuda")
    tokens = _tokens(model.arch.vocab_size, seed=1)
    ours = run_schedule(PagedSim(model, block_size=4, num_blocks=32, seed=2, device="cuda"), tokens, SCHEDULE)
    ref = hf_logits(load_hf_model(path).cuda(), tokens, device="cuda")
    for s in tokens:
        torch.testing.assert_close(ours[s], ref[s], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_cuda_tracks_transformers(case, tmp_path):
    family, overrides = CASES[case]
    path = make_tiny_checkpoint(family, tmp_path / case, seed=3, **overrides)
    model = load_model(path, torch.bfloat16, "cuda")
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in model.parameters())
    tokens = _tokens(model.arch.vocab_size, seed=1)
    ours = run_schedule(PagedSim(model, block_size=4, num_blocks=32, seed=2, device="cuda"), tokens, SCHEDULE)
    ref32 = hf_logits(load_hf_model(path).cuda(), tokens, device="cuda")
    ref16 = hf_logits(load_hf_model(path, torch.bfloat16).cuda(), tokens, device="cuda")
    ours_all, r32, r16 = (torch.cat([d[s] for s in tokens]) for d in (ours, ref32, ref16))
    err_ours, err_hf = (ours_all - r32).abs().mean().item(), (r16 - r32).abs().mean().item()
    assert err_ours <= 1.5 * err_hf + 0.01, (err_ours, err_hf)
    agree_ours = (ours_all.argmax(-1) == r32.argmax(-1)).float().mean().item()
    agree_hf = (r16.argmax(-1) == r32.argmax(-1)).float().mean().item()
    assert agree_ours >= agree_hf - 0.1, (agree_ours, agree_hf)
