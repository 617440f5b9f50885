"""fp8 block-scaled checkpoints (DeepSeek-V3's and Qwen3's FP8 format): loaded without a bf16 copy of any quantized
weight, every linear weight of the decoder layers fp8 with its block scales; without a W8A8 kernel (the CPU) each
GEMM dequantizes its weight, so the model equals the same weights dequantized by the test's own quantizer and saved
as a float32 checkpoint (tests/fp8_ckpt.py), step by step and in the engine's greedy tokens."""
import pytest
import torch

from fp8_ckpt import make_fp8_pair
from moe_infer.models import load_model
from paged_sim import PagedSim, run_schedule
from parity_cases import SCHEDULE, make_tokens
from tiny_hf import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)

FP8 = torch.float8_e4m3fn
CASES = {  # family -> config overrides whose widths the 16 x 16 blocks divide where a weight is split or fused
    "deepseek_v3": dict(q_lora_rank=32, moe_intermediate_size=16, intermediate_size=48),
    "qwen3_moe": dict(head_dim=16, moe_intermediate_size=32, intermediate_size=80),
}


def _pair(family, tmp_path):
    src = make_tiny_checkpoint(family, tmp_path / "src", seed=3, per_expert_names=True, **CASES[family])
    return make_fp8_pair(src, str(tmp_path / "fp8"), str(tmp_path / "ref"))


@pytest.mark.parametrize("family", list(CASES))
def test_fp8_model_equals_its_dequantized_weights(family, tmp_path):
    fp8_dir, ref_dir = _pair(family, tmp_path)
    model = load_model(fp8_dir, torch.float32, "cpu")
    ref = load_model(ref_dir, torch.float32, "cpu")
    q = model.arch.quant
    assert (q.method, q.block_n, q.block_k) == ("fp8", 16, 16)
    layer = model.layers[1]
    fp8_params = [n for n, p in model.named_parameters() if p.dtype == FP8]
    assert layer.mlp.store.w13_E2FD.dtype == FP8 and layer.mlp.store.w13_E2FD_scale_inv.dtype == torch.float32
    assert fp8_params and all(n.startswith("layers.") for n in fp8_params) and not any(n.endswith("mlp.gate.weight") for n in fp8_params)
    assert model.lm_head.weight.dtype == torch.float32 and layer.mlp.gate.weight.dtype == torch.float32
    tokens = make_tokens(model.arch.vocab_size, seed=1)
    ours = run_schedule(PagedSim(model, block_size=4, num_blocks=32), tokens, SCHEDULE)
    want = run_schedule(PagedSim(ref, block_size=4, num_blocks=32), tokens, SCHEDULE)
    for s in tokens:
        assert want[s].std() > 0.5
        torch.testing.assert_close(ours[s], want[s], atol=1e-4, rtol=1e-4)


def test_fp8_engine_tokens_equal_the_dequantized_checkpoint(tmp_path):
    from moe_infer import LLM, SamplingParams

    fp8_dir, ref_dir = _pair("deepseek_v3", tmp_path)
    prompts = [[5, 9, 13, 17, 21, 25, 29], [40, 41, 42], [7, 7, 8, 8, 9, 9, 10, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = []
    for path in (fp8_dir, ref_dir):
        llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=32,
                  max_num_batched_tokens=8)
        tokens.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                     params, use_tqdm=False)])
    assert tokens[0] == tokens[1]


def test_fp8_scales_are_read_not_left_at_one(tmp_path):
    """The scales matter: the same fp8 data with every scale replaced by 1 gives other logits (so the equality
    above is not two models that both ignore them)."""
    fp8_dir, _ = _pair("deepseek_v3", tmp_path)
    model = load_model(fp8_dir, torch.float32, "cpu")
    tokens = make_tokens(model.arch.vocab_size, seed=1)
    a = run_schedule(PagedSim(model, block_size=4, num_blocks=32), tokens, SCHEDULE)
    for name, buf in model.named_buffers():
        if name.endswith("_scale_inv"):
            buf.fill_(1.0)
    model.layers[1].self_attn._absorbed = None
    b = run_schedule(PagedSim(model, block_size=4, num_blocks=32), tokens, SCHEDULE)
    assert not torch.allclose(a[0], b[0], atol=1e-2)


def _w8a8_errors(fp8_dir, ref_dir, device, experts):
    """|logit error| of the fp8 model (W8A8 where the kernels run) and of the dequantized-weights model in bf16,
    both against the dequantized-weights model in float32, over the parity schedule: the median over tokens of the
    per-token mean (a near-tied router choice flipped by rounding moves a few tokens by O(1): DeepSeek-V3 in bf16
    alone erred 0.145 in the mean on the H200; parity_cases.low_precision_errors), and the mean |logit| as scale."""
    from moe_infer.layers.moe import MoEBackends

    tokens = None
    out = {}
    for name, path, dtype, backends in (("fp8", fp8_dir, torch.bfloat16, MoEBackends(experts=experts)),
                                        ("bf16", ref_dir, torch.bfloat16, MoEBackends(experts=experts)),
                                        ("fp32", ref_dir, torch.float32, None)):
        model = load_model(path, dtype, device, backends)
        tokens = tokens or make_tokens(model.arch.vocab_size, seed=1)
        out[name] = torch.cat(list(run_schedule(PagedSim(model, block_size=4, num_blocks=32, device=device), tokens,
                                                SCHEDULE).values())).float().cpu()
    err = {k: (out[k] - out["fp32"]).abs().mean(-1).median().item() for k in ("fp8", "bf16")}
    err["scale"] = out["fp32"].abs().mean().item()
    return err


@pytest.mark.parametrize("family", list(CASES))
def test_fp8_w8a8_experts_kernel_tracks_the_dequantized_model(family, tmp_path, monkeypatch):
    """The W8A8 grouped experts kernel (interpreter on CPU; activations quantized per token group, so not equal
    to the dequantized model): its error against the float32 model stays within a few times bf16's own."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CUDA or under TRITON_INTERPRET=1")
    from moe_infer.plugins import load_plugins

    load_plugins()
    from moe_infer.kernels import fused_moe_fp8 as kernel

    calls, real = [], kernel.fused_moe_fp8
    monkeypatch.setattr(kernel, "fused_moe_fp8", lambda *a: calls.append(1) or real(*a))
    fp8_dir, ref_dir = _pair(family, tmp_path)
    err = _w8a8_errors(fp8_dir, ref_dir, "cuda" if torch.cuda.is_available() else "cpu", "triton")
    assert calls and err["fp8"] <= 4 * err["bf16"] + 0.02 * err["scale"], err


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(CASES))
def test_fp8_w8a8_linear_kernel_runs_on_the_gpu(family, tmp_path):
    """On the GPU the dense fp8 layers take the W8A8 kernel (not the dequantizing fallback)."""
    from moe_infer.layers.quant_triton import has_fp8_dot
    from moe_infer.plugins import load_plugins
    from moe_infer.quant import FP8_LINEAR_KERNELS

    load_plugins()
    if not has_fp8_dot(0):
        pytest.skip("fp8 tensor-core dots need compute capability 8.9+")
    calls = []
    real = FP8_LINEAR_KERNELS.get("triton")
    FP8_LINEAR_KERNELS._entries["triton"] = lambda *a: calls.append(1) or real(*a)
    try:
        fp8_dir, ref_dir = _pair(family, tmp_path)
        err = _w8a8_errors(fp8_dir, ref_dir, "cuda", "triton")
    finally:
        FP8_LINEAR_KERNELS._entries["triton"] = real
    # W8A8 rounds every GEMM's activations to e4m3 (3 mantissa bits, a scale per 16 values here): on these tiny
    # random models the logits move by 8-16 % of their mean magnitude (H200: Qwen3-MoE 0.20 of 1.21; bf16 alone
    # 0.02). The kernels' own exactness is checked against their references (test_fp8_gemm.py,
    # test_fp8_fused_moe.py); this bound catches a path that is wrong (every scale 1.5x off moved them by 0.76 of
    # 1.21 on the CPU).
    assert calls and err["fp8"] <= 0.25 * err["scale"], err


def test_shards_are_read_in_whole_scale_blocks():
    """A tensor-parallel shard of an fp8 weight reads its scales in whole blocks; one that cuts a block is refused."""
    from moe_infer.models.loader import _ALL, _block_index
    from moe_infer.quant import QuantSpec

    spec = QuantSpec("fp8", 128, 128)
    assert _block_index((slice(256, 512), _ALL), 2, spec) == (slice(2, 4), _ALL)  # rows of a [N, K] weight
    assert _block_index((3, slice(0, 2048)), 3, spec) == (3, slice(0, 16))  # an expert's rows of [E, N, K]
    assert _block_index((_ALL, slice(128, None)), 2, spec) == (_ALL, slice(1, None))
    with pytest.raises(ValueError, match="cuts the fp8 checkpoint's 128-wide scale blocks"):
        _block_index((slice(64, 192),), 2, spec)
