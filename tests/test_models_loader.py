"""Checkpoint loading: expert namings, shards, local experts, dtypes, and clear errors on bad input."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.layers.moe import MoEBackends
from moe_infer.models import load_arch, load_model
from tiny_hf import FAMILIES, make_tiny_checkpoint, read_state_dict


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_namings_and_shards_load_identical_weights(family, tmp_path):
    fused = load_model(make_tiny_checkpoint(family, tmp_path / "f", seed=7), torch.float32, "cpu")
    names = family != "gpt_oss"  # GPT-OSS checkpoints come with fused experts only: the shards alone differ
    per_expert = make_tiny_checkpoint(family, tmp_path / "p", seed=7, per_expert_names=names, sharded=True)
    assert os.path.isfile(os.path.join(per_expert, "model.safetensors.index.json"))
    assert any(".experts.0." in k for k in read_state_dict(per_expert)) == names
    other = load_model(per_expert, torch.float32, "cpu")
    a, b = _state(fused), _state(other)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_expert_store_holds_gate_then_up(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "q", seed=1, per_expert_names=True)
    sd = read_state_dict(path)
    model = load_model(path, torch.float32, "cpu")
    w13_E2FD, w2_EDF = model.layers[0].mlp.store.weights()
    F = model.arch.moe_intermediate_size
    assert torch.equal(w13_E2FD[3, :F], sd["model.layers.0.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(w13_E2FD[3, F:], sd["model.layers.0.mlp.experts.3.up_proj.weight"])
    assert torch.equal(w2_EDF[3], sd["model.layers.0.mlp.experts.3.down_proj.weight"])


@pytest.mark.parametrize("per_expert", [False, True])
def test_only_local_experts_are_loaded(per_expert, tmp_path):
    path = make_tiny_checkpoint("olmoe", tmp_path / "o", seed=2, per_expert_names=per_expert)
    full = load_model(path, torch.float32, "cpu")
    E = full.arch.num_experts
    backends = MoEBackends(dispatcher=LocalDispatcher(E, num_local_experts=3, expert_start=2))
    part = load_model(path, torch.float32, "cpu", backends=backends)
    for lf, lp in zip(full.moe_layers(), part.moe_layers()):
        w13_full, w2_full = lf.store.weights()
        w13_part, w2_part = lp.store.weights()
        assert w13_part.shape[0] == 3
        assert torch.equal(w13_part, w13_full[2:5]) and torch.equal(w2_part, w2_full[2:5])


@pytest.mark.parametrize("per_expert", [False, True])
def test_placement_with_replicas_loads_listed_experts(per_expert, tmp_path):
    """An EP placement may hold any experts, a hot one twice: slot s gets expert local_expert_ids[s]."""
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "q", seed=2, per_expert_names=per_expert)
    full = load_model(path, torch.float32, "cpu")
    ids = [6, 7, 1, 6]
    disp = LocalDispatcher(full.arch.num_experts, num_local_experts=4, expert_start=0)
    disp.local_expert_ids = ids
    part = load_model(path, torch.float32, "cpu", backends=MoEBackends(dispatcher=disp))
    for lf, lp in zip(full.moe_layers(), part.moe_layers()):
        assert torch.equal(lp.store.w13_E2FD, lf.store.w13_E2FD[ids])
        assert torch.equal(lp.store.w2_EDF, lf.store.w2_EDF[ids])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_load(dtype, tmp_path):
    path = make_tiny_checkpoint("mixtral", tmp_path / "m", seed=4)
    ref = load_model(path, torch.float32, "cpu")
    low = load_model(path, dtype, "cpu")
    assert all(p.dtype == dtype for p in low.parameters())
    assert low.kv_cache_bytes_per_block(16) * 2 == ref.kv_cache_bytes_per_block(16)
    low_w2, ref_w2 = low.layers[1].mlp.store.w2_EDF, ref.layers[1].mlp.store.w2_EDF
    torch.testing.assert_close(low_w2.float(), ref_w2, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("tied", [False, True])
def test_tied_embeddings(tied, tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "t", seed=5, tie_word_embeddings=tied)
    model = load_model(path, torch.float32, "cpu")
    assert model.arch.tie_word_embeddings is tied
    assert (model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()) is tied
    if not tied:
        sd = read_state_dict(path)
        assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])


def test_arch_fields(tmp_path):
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "q2", mlp_only_layers=[1], decoder_sparse_step=1)
    arch, _ = load_arch(path)
    assert arch.family == "qwen2_moe" and arch.moe_layer_ids == [0, 2] and arch.qkv_bias
    assert arch.shared_expert_intermediate_size == 40 and arch.eos_token_ids == [2]
    arch, _ = load_arch(make_tiny_checkpoint("qwen3_moe", tmp_path / "q3", decoder_sparse_step=2))
    assert arch.moe_layer_ids == [1] and arch.head_dim == 24 and arch.qk_norm == "head"


# ---- bad input -------------------------------------------------------------------------------


def _rewrite(path, fn):
    file = os.path.join(path, "model.safetensors")
    sd = fn(load_file(file))
    save_file(sd, file, metadata={"format": "pt"})


def test_unknown_architecture(tmp_path):
    path = make_tiny_checkpoint("mixtral", tmp_path / "m")
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["architectures"] = ["MixtralForSequenceClassification"]
    json.dump(cfg, open(cfg_file, "w"))
    msg = "unsupported model architecture: MixtralForSequenceClassification.*supported:.*Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match=msg):
        load_model(path, torch.float32, "cpu")


def test_config_without_architectures_uses_model_type(tmp_path):
    path = make_tiny_checkpoint("olmoe", tmp_path / "o")
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    del cfg["architectures"]
    json.dump(cfg, open(cfg_file, "w"))
    assert load_arch(path)[0].family == "olmoe"


def test_not_a_local_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        load_model(str(tmp_path / "nope"), torch.float32, "cpu")


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(damage, tmp_path):
    path = make_tiny_checkpoint("olmoe", tmp_path / "o")
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    data = data[: len(data) // 2] if damage == "truncate" else b"\xff" * 16 + data[16:]
    open(file, "wb").write(data)
    with pytest.raises(ValueError, match="corrupt safetensors file .*model.safetensors"):
        load_model(path, torch.float32, "cpu")


def test_corrupt_shard(tmp_path):
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "q", sharded=True)
    shard = os.path.join(path, "model-00002-of-00003.safetensors")
    open(shard, "wb").write(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="corrupt safetensors file .*model-00002-of-00003.safetensors"):
        load_model(path, torch.float32, "cpu")


def test_missing_tensor(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "q")
    _rewrite(path, lambda sd: {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_norm.weight"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path, torch.float32, "cpu")


def test_missing_expert(tmp_path):
    path = make_tiny_checkpoint("mixtral", tmp_path / "m", per_expert_names=True)
    _rewrite(path, lambda sd: {k: v for k, v in sd.items() if "experts.4.w3" not in k})
    with pytest.raises(ValueError, match=r"missing tensors: .*experts\.4\.w3\.weight"):
        load_model(path, torch.float32, "cpu")


def test_wrong_shape(tmp_path):
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "q")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    _rewrite(path, lambda sd: {**sd, name: sd[name][:, :-1].contiguous()})
    msg = r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \[8, 63, 64\], expected \[8, 64, 64\]"
    with pytest.raises(ValueError, match=msg):
        load_model(path, torch.float32, "cpu")


def test_unexpected_tensor(tmp_path):
    path = make_tiny_checkpoint("olmoe", tmp_path / "o")
    _rewrite(path, lambda sd: {**sd, "model.layers.0.mlp.mystery.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"unexpected tensors .*model\.layers\.0\.mlp\.mystery\.weight"):
        load_model(path, torch.float32, "cpu")


def test_generation_config_adds_eos_ids(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "q")
    json.dump({"eos_token_id": [7, 2]}, open(os.path.join(path, "generation_config.json"), "w"))
    arch, _ = load_arch(path)
    assert arch.eos_token_ids == [2, 7]


def test_unknown_attention_backend(tmp_path):
    path = make_tiny_checkpoint("olmoe", tmp_path / "o")
    with pytest.raises(KeyError, match="unknown attention backend 'flash'; available: .*torch"):
        load_model(path, torch.float32, "cpu", attn_backend="flash")
