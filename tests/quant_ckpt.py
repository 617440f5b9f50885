"""Reference checkpoints for online quantization tests: every linear weight of the decoder layers but the routers
quantized and dequantized by naive quantizers written here (independent of moe_infer.quant / kernels.w4_format),
saved as a plain float32 checkpoint: what a model quantized at load must equal on a path that dequantizes."""
from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import save_file

from fp8_ckpt import _quantize
from tiny_hf import read_state_dict


def int4_fake_quant(w_NK: torch.Tensor, group: int) -> torch.Tensor:
    """Symmetric int4 per group of `group` along K, round to nearest: scale = amax / 7, codes in [-8, 7]."""
    out = torch.empty_like(w_NK, dtype=torch.float32)
    for n in range(w_NK.shape[0]):
        for g0 in range(0, w_NK.shape[1], group):
            blk = w_NK[n, g0:g0 + group].float()
            scale = torch.clamp(blk.abs().max() / 7.0, min=1e-10)
            out[n, g0:g0 + group] = torch.clamp(torch.round(blk / scale), -8, 7) * scale
    return out


def fp8_fake_quant(w_NK: torch.Tensor, block: int) -> torch.Tensor:
    return _quantize(w_NK, block, block)[2]


def _is_quantized(name: str) -> bool:
    """Linear weights of the decoder layers but the routers (`mlp.gate`, Mixtral's `block_sparse_moe.gate`)."""
    return (".layers." in name and name.endswith(".weight") and "norm" not in name
            and not name.endswith(".gate.weight"))


def make_fake_quant_ref(src: str, out_dir: str, fake_quant) -> str:
    """The float32 checkpoint `src` with every quantizable weight (per-expert 2-D tensors) fake-quantized."""
    sd = read_state_dict(src)
    ref = {}
    for name, t in sd.items():
        if _is_quantized(name):
            if t.dim() != 2:
                raise ValueError(f"{name}: per-expert 2-D weights only (make the checkpoint with per_expert_names)")
            ref[name] = fake_quant(t)
        else:
            ref[name] = t
    shutil.copytree(src, out_dir, dirs_exist_ok=True)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(out_dir, f))
    save_file(ref, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir
