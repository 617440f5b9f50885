"""Tiny compressed-tensors "pack-quantized" (W4A16) checkpoints for the tests, written from the format's description
(independent of moe_infer): every linear weight of the decoder layers but the routers quantized symmetric int4 per
group of `group` along K (scale = amax / 7, q = round(w / scale) in [-8, 7]), stored as `weight_packed` int32
[N, K / 8] holding q + 8 at bits 4j..4j+3 for column 8i + j, `weight_scale` [N, K / group] and `weight_shape`; the
config's `quantization_config` names the scheme. And the same weights dequantized, saved as a plain float32
checkpoint: what transformers loads as the reference."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from tiny_hf import read_state_dict


def _quantize(w_NK: torch.Tensor, group: int):
    N, K = w_NK.shape
    packed = torch.zeros(N, K // 8, dtype=torch.int64)
    scale = torch.empty(N, K // group)
    deq = torch.empty(N, K)
    for n in range(N):
        for g in range(K // group):
            blk = w_NK[n, g * group:(g + 1) * group].double()
            s = max(float(blk.abs().max()) / 7.0, 1e-10)
            s = float(torch.tensor(s, dtype=torch.float32))
            scale[n, g] = s
            for j, x in enumerate(blk.tolist()):
                q = int(max(-8, min(7, round(x / s))))
                col = g * group + j
                deq[n, col] = q * s
                packed[n, col // 8] |= (q + 8) << (4 * (col % 8))
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed, scale, deq


def _is_quantized(name: str) -> bool:
    return (".layers." in name and name.endswith(".weight") and "norm" not in name
            and not name.endswith(".gate.weight"))


def make_pack_quantized_pair(src: str, ct_dir: str, ref_dir: str, group: int = 16) -> tuple:
    sd = read_state_dict(src)
    ct, ref = {}, {}
    for name, t in sd.items():
        if _is_quantized(name):
            packed, scale, deq = _quantize(t, group)
            base = name[:-len(".weight")]
            ct[base + ".weight_packed"], ct[base + ".weight_scale"] = packed, scale
            ct[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            ref[name] = deq
        else:
            ct[name] = ref[name] = t
    for folder, tensors in ((ct_dir, ct), (ref_dir, ref)):
        shutil.copytree(src, folder, dirs_exist_ok=True)
        for f in os.listdir(folder):
            if f.endswith(".safetensors") or f.endswith(".index.json"):
                os.remove(os.path.join(folder, f))
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ct_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": group}}}}
    with open(os.path.join(ct_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return ct_dir, ref_dir
