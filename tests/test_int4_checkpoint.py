"""compressed-tensors pack-quantized (W4A16) checkpoints: loaded packed (int32 words, scales; never in bf16), every
linear weight of the decoder layers int4; on the CPU each GEMM dequantizes its weight, so the logits equal
transformers' on the same weights dequantized by the test's own packer (tests/ct_ckpt.py)."""
import pytest
import torch

from ct_ckpt import make_pack_quantized_pair
from moe_infer.models import load_model
from paged_sim import PagedSim, run_schedule
from parity_cases import SCHEDULE, hf_logits, make_tokens
from tiny_hf import load_hf_model, make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)

CASES = {"qwen3_moe": dict(head_dim=16, moe_intermediate_size=32, intermediate_size=96), "mixtral": dict()}


@pytest.mark.parametrize("family", list(CASES))
def test_pack_quantized_model_equals_transformers_on_the_dequantized_weights(family, tmp_path):
    src = make_tiny_checkpoint(family, tmp_path / "src", seed=3, per_expert_names=True, **CASES[family])
    ct_dir, ref_dir = make_pack_quantized_pair(src, str(tmp_path / "ct"), str(tmp_path / "ref"))
    model = load_model(ct_dir, torch.float32, "cpu")
    q = model.arch.quant
    assert (q.method, q.group_size, q.symmetric, q.online) == ("int4", 16, True, False)
    assert model.layers[1].mlp.store.w13_E2FD.dtype == torch.int32
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int32
    tokens = make_tokens(model.arch.vocab_size, seed=1)
    ours = run_schedule(PagedSim(model, block_size=4, num_blocks=32), tokens, SCHEDULE)
    want = hf_logits(load_hf_model(ref_dir), tokens)
    plain = hf_logits(load_hf_model(src), tokens)
    for s in tokens:
        torch.testing.assert_close(ours[s], want[s], atol=1e-4, rtol=1e-4)
        assert (plain[s] - want[s]).abs().max() > 1e-2  # the quantization is visible


def test_unsupported_compressed_tensors_schemes_are_refused():
    from types import SimpleNamespace

    from moe_infer.quant import parse_quant

    def cfg(ignore=("lm_head",), **overrides):
        w = {**dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128), **overrides}
        return SimpleNamespace(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                    "config_groups": {"g": {"weights": w}}, "ignore": list(ignore)})

    assert parse_quant(cfg()).group_size == 128
    with pytest.raises(NotImplementedError, match="zero points"):
        parse_quant(cfg(symmetric=False))
    with pytest.raises(NotImplementedError, match="only 4-bit int group-wise"):
        parse_quant(cfg(num_bits=8))
    with pytest.raises(NotImplementedError, match="unquantized layers among"):
        parse_quant(cfg(ignore=("lm_head", "model.layers.0.self_attn.o_proj")))
    with pytest.raises(NotImplementedError, match="only one 'pack-quantized'"):
        parse_quant(SimpleNamespace(quantization_config={"quant_method": "compressed-tensors",
                                                         "format": "float-quantized", "config_groups": {"g": {}}}))
