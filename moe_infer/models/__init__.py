"""Models: HF checkpoint -> ModelArch -> MoEModel (generic decoder over a paged KV cache).

    model = load_model(path, torch.bfloat16, "cuda")        # eval, no grad
    hidden_TD = model(input_ids_T, positions_T)             # inside forward_context(attn_metadata)
    logits_BV = model.compute_logits(hidden_TD[last_rows])   # float32
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from moe_infer.layers.moe import MoEBackends
from moe_infer.layers.paged_attention import resolve_attention_backend
from moe_infer.models.arch import ModelArch
from moe_infer.models.hf_config import arch_from_config, load_arch
from moe_infer.models.decoder import MoEModel
from moe_infer.models.dummy import init_dummy_weights
from moe_infer.models.families import MODEL_FAMILIES
from moe_infer.models.loader import load_weights
from moe_infer.models.mtp import build_mtp_layers
from moe_infer.models.online_quant import with_online_quant
from moe_infer.models.shard import WHOLE, ModelShard

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load_model(
    path: str,
    dtype: torch.dtype,
    device: Union[torch.device, str],
    backends: Optional[MoEBackends] = None,
    attn_backend: str = "auto",
    load_format: str = "auto",
    shard: ModelShard = WHOLE,
    mtp: bool = False,
    quantization: Optional[str] = None,
) -> MoEModel:
    """Build the model of the local checkpoint folder `path` on `device` in `dtype` and load its weights.

    Only the experts of each MoE layer's dispatcher (`backends.dispatcher`) are read. attn_backend
    names an entry of `moe_infer.layers.paged_attention.ATTENTION_BACKENDS`; "auto": the first
    registered of ATTENTION_AUTO for the device (CPU: the float32 reference "torch"; CUDA: "triton").
    load_format "dummy": random weights, no safetensors read (moe_infer.models.dummy). shard: this rank's
    stage layers and tensor shards (whole model by default); only those tensors are read. mtp: also build and load
    the checkpoint's multi-token-prediction layers (DeepSeek-V3; `model.mtp`, on the last stage, models/mtp.py).
    quantization "fp8" / "int4": a bf16 checkpoint's linear weights quantized as they are read
    (moe_infer/models/online_quant.py).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype}")
    attn_backend = resolve_attention_backend(attn_backend, device)
    arch, hf_config = load_arch(path)
    arch = with_online_quant(arch, quantization, device)
    with torch.device(device):
        model = MoEModel(arch, hf_config, dtype, backends, attn_backend, shard)
        if mtp:
            model.mtp = build_mtp_layers(arch, hf_config, model.rotary, model.backends, dtype, attn_backend, shard)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        load_weights(model, path)
    return model.eval()


__all__ = ["ModelArch", "ModelShard", "MoEModel", "MoEBackends", "MODEL_FAMILIES", "arch_from_config", "load_arch",
           "load_model"]
