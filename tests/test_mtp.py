"""DeepSeek-V3's multi-token-prediction layer (moe_infer/models/mtp.py), built and loaded on request, against
transformers' own DeepSeek-V3 decoder layer for the block and the published equations (plain torch) around it."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_infer.layers.forward_context import forward_context
from moe_infer.models import load_model
from paged_sim import PagedSim
from tiny_hf import hf_model_class, make_tiny_checkpoint

pytestmark = pytest.mark.timeout(180)


def _checkpoint_with_mtp(tmp_path):
    """A tiny DeepSeek-V3 checkpoint of L decoder layers plus one MTP layer (model.layers.L.*: the block as
    transformers writes a decoder layer, then enorm, hnorm, eh_proj, embed_tokens, shared_head), and the
    transformers model of L + 1 layers whose last layer is that block."""
    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "ds", seed=0)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    L = cfg["num_hidden_layers"]
    config_cls, model_cls = hf_model_class("deepseek_v3")
    config = config_cls(**{**cfg, "num_hidden_layers": L + 1})
    config._attn_implementation = "eager"
    torch.manual_seed(7)
    hf = model_cls(config).eval()
    # the MoE router of the block: a correction bias that matters, as in a trained checkpoint
    hf.model.layers[L].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    out_dir = tmp_path / "hf"
    hf.save_pretrained(out_dir)
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    block = {k: v for k, v in load_file(os.path.join(out_dir, "model.safetensors")).items()
             if k.startswith(f"model.layers.{L}.")}
    assert block, "transformers wrote no tensors of the extra layer"
    D, V = config.hidden_size, config.vocab_size
    g = torch.Generator().manual_seed(3)
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
             "hnorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
             "eh_proj.weight": torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5,
             "embed_tokens.weight": torch.randn(V, D, generator=g),
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
             "shared_head.head.weight": torch.randn(V, D, generator=g) / D ** 0.5}
    sd.update(block)
    sd.update({f"model.layers.{L}.{k}": v for k, v in extra.items()})
    save_file(sd, file, metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path, hf, extra, L


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(hf, extra, L, ids, positions, hidden):
    """The MTP layer by its equations: x = eh_proj([enorm(embed(t)) | hnorm(h)]) (position 0's embedding zeroed),
    transformers' decoder layer L over x (causal), shared_head's norm and head."""
    eps = hf.config.rms_norm_eps
    e = extra["embed_tokens.weight"][ids] * (positions != 0)[:, None]
    x = torch.cat((_rms(e, extra["enorm.weight"], eps), _rms(hidden, extra["hnorm.weight"], eps)), -1)
    x = x @ extra["eh_proj.weight"].T
    T = len(ids)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    pos = positions[None]
    y = hf.model.layers[L](x[None], attention_mask=mask, position_ids=pos,
                           position_embeddings=hf.model.rotary_emb(x[None], pos))[0]
    return _rms(y, extra["shared_head.norm.weight"], eps) @ extra["shared_head.head.weight"].T


def test_mtp_layer_matches_its_equations_over_transformers_block(tmp_path):
    path, hf, extra, L = _checkpoint_with_mtp(tmp_path)
    model = load_model(path, torch.float32, "cpu", mtp=True)
    assert model.mtp is not None and len(model.mtp) == 1
    mtp = model.mtp[0]
    g = torch.Generator().manual_seed(5)
    T = 7
    ids = torch.randint(3, model.arch.vocab_size, (T,), generator=g)
    hidden = torch.randn(T, model.arch.hidden_size, generator=g)
    positions = torch.arange(T)
    with torch.no_grad():
        ref = _reference(hf, extra, L, ids, positions, hidden)
    # our layer over a paged cache of its own: the first 4 rows as a prompt chunk, then one row a step
    sim = PagedSim(mtp, block_size=2, num_blocks=8, seed=1)
    got = []
    for a, b in [(0, 4), (4, 5), (5, 6), (6, 7)]:
        ids_T, attn = sim.metadata({0: ids[a:b].tolist()})
        with forward_context(attn):
            got.append(mtp.compute_logits(mtp.predict(ids_T, attn.positions_T, hidden[a:b])))
        sim.num_cached[0] = b
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=1e-4)


def test_mtp_layers_are_read_only_on_request(tmp_path):
    """Without mtp the MTP tensors are known and left unread (no memory spent); with it, a checkpoint that lacks
    them, or a config without MTP layers, is refused by name."""
    path, _, _, L = _checkpoint_with_mtp(tmp_path)
    plain = load_model(path, torch.float32, "cpu")
    assert plain.mtp is None and not any(n.startswith("mtp.") for n, _ in plain.named_parameters())
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    save_file({k: v for k, v in sd.items() if not k.startswith(f"model.layers.{L}.eh_proj")}, file,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing tensors: model.layers.{L}.eh_proj.weight"):
        load_model(path, torch.float32, "cpu", mtp=True)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 0
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="declares no multi-token-prediction layers"):
        load_model(path, torch.float32, "cpu", mtp=True)


def test_mtp_block_keeps_out_of_the_main_models_statistics(tmp_path):
    """The MTP block's MoE layer does not count into the model's expert-load statistics (kept per decoder layer)
    or its list of MoE layers."""
    from moe_infer.layers.moe import MoEBackends
    from moe_infer.routing.stats import ExpertLoadStats

    path, _, _, L = _checkpoint_with_mtp(tmp_path)
    model = load_model(path, torch.float32, "cpu", mtp=True)
    stats = ExpertLoadStats(L, model.arch.num_experts, "cpu")
    model = load_model(path, torch.float32, "cpu", backends=MoEBackends(stats=stats), mtp=True)
    assert all(layer.layer_idx < L for layer in model.moe_layers()) and model.mtp[0].is_moe
    mtp = model.mtp[0]
    sim = PagedSim(mtp, block_size=2, num_blocks=8)
    ids_T, attn = sim.metadata({0: [3, 4, 5]})
    with forward_context(attn):
        mtp.predict(ids_T, attn.positions_T, torch.randn(3, model.arch.hidden_size))
    stats.flush()
    assert int(stats.routed_LE.sum()) == 0
