"""DeepSeek-V2/V3 specifics beside the parity tests (test_models_parity.py, test_engine_parity.py): the latent KV
cache's size, the multi-token-prediction layers of a real checkpoint, refused configurations."""
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_infer.models import load_arch, load_model
from tiny_hf import edit_config, make_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)


def test_latent_cache_bytes_per_token(tmp_path, caplog):
    """One latent row of kv_lora_rank + qk_rope_head_dim values a token a layer, not per-head K/V; the engine
    says so at start-up, with what per-head K/V of the same heads would take."""
    from moe_infer import LLM

    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "ds", seed=0)
    model = load_model(path, torch.bfloat16, "cpu")
    arch = model.arch
    row = arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim  # 32 + 8
    assert model.kv_cache_bytes_per_block(16) == 16 * arch.num_layers * row * 2
    assert model.kv_cache_shapes(7, 16) == [((7, 16, 1, row),)] * arch.num_layers
    per_head = arch.num_heads * (arch.mla.qk_head_dim + arch.mla.v_head_dim)  # 4 x (24 + 12)
    with caplog.at_level(logging.INFO, logger="moe_infer.engine.model_runner"):
        LLM(model=path, dtype="bfloat16", device="cpu", block_size=16, num_kv_blocks=8)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert f"{arch.num_layers * row * 2} bytes a token" in line and f"would take {per_head}" in line, line


def test_mtp_layers_of_a_checkpoint_are_known_not_read(tmp_path):
    """DeepSeek-V3 checkpoints hold their multi-token-prediction layer after the decoder's (model.layers.61.*):
    with num_nextn_predict_layers it loads (those tensors unread); without, they are unexpected tensors."""
    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "ds", seed=0)
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    n = 3  # num_hidden_layers of the tiny config
    sd[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    sd[f"model.layers.{n}.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 28, 32)
    save_file(sd, file, metadata={"format": "pt"})
    edit_config(path, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=f"unexpected tensors.*model.layers.{n}"):
        load_model(path, torch.float32, "cpu")
    edit_config(path, num_nextn_predict_layers=1)
    load_model(path, torch.float32, "cpu")


@pytest.mark.parametrize("qcfg,match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
    ({"quant_method": "fp8"}, "without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["model.layers.0.mlp"]},
     "modules_to_not_convert"),
])
def test_unsupported_quantization_is_refused_by_name(tmp_path, qcfg, match):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "ds", seed=0)
    edit_config(path, quantization_config=qcfg)
    with pytest.raises(NotImplementedError, match=match):
        load_arch(path)


@pytest.mark.parametrize("family,fields,match", [
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
])
def test_unsupported_router_variants_are_refused(tmp_path, family, fields, match):
    path = make_tiny_checkpoint(family, tmp_path / "ds", seed=0)
    edit_config(path, **fields)
    with pytest.raises(ValueError, match=match):
        load_arch(path)
