"""Tiny fp8 block-scaled checkpoints for the tests, made from a tiny float32 one (tiny_hf.py) by a naive
quantizer written here (independent of moe_infer.quant): e4m3 weights, one float32 scale per block
(`weight_scale_inv`, DeepSeek's format) for every linear weight of the decoder layers but the routers; and the
same weights dequantized, saved as a plain float32 checkpoint: the reference the fp8 model must equal on a
path that dequantizes its weights."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from tiny_hf import read_state_dict

E4M3_MAX = 448.0


def _quantize(w_NK: torch.Tensor, bn: int, bk: int):
    N, K = w_NK.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-N // bn), -(-K // bk))
    deq = torch.empty(N, K)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w_NK[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = max(blk.abs().max().item(), 1e-12) / E4M3_MAX
            qb = (blk / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qb
            deq[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qb.float() * s
            scale[i, j] = s
    return q, scale, deq


def _is_quantized(name: str) -> bool:
    return (".layers." in name and name.endswith(".weight") and "norm" not in name
            and not name.endswith("mlp.gate.weight"))


def make_fp8_pair(src: str, fp8_dir: str, ref_dir: str, block=(16, 16)) -> tuple:
    """(fp8 checkpoint folder, dequantized float32 checkpoint folder) of the float32 checkpoint `src`."""
    sd = read_state_dict(src)
    fp8, ref = {}, {}
    for name, t in sd.items():
        if _is_quantized(name):
            if t.dim() != 2:
                raise ValueError(f"{name}: per-expert 2-D weights only (make the checkpoint with per_expert_names)")
            q, scale, deq = _quantize(t, *block)
            fp8[name], fp8[name + "_scale_inv"], ref[name] = q, scale, deq
        else:
            fp8[name] = ref[name] = t
    for folder, tensors in ((fp8_dir, fp8), (ref_dir, ref)):
        shutil.copytree(src, folder, dirs_exist_ok=True)
        for f in os.listdir(folder):
            if f.endswith(".safetensors") or f.endswith(".index.json"):
                os.remove(os.path.join(folder, f))
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return fp8_dir, ref_dir
