"""Online quantization (`LLM(..., quantization="fp8" | "int4")`, vLLM's names): a bf16 checkpoint's linear weights
quantized as the loader reads them (moe_infer/quant.py: `store` of the weight's format), every linear weight of the
decoder layers but the routers, as a quantized checkpoint would have them.

  fp8   128 x 128 blocks of e4m3 with a float32 scale each (DeepSeek-V3's layout), so the W8A8 kernels of the fp8
        checkpoints run; on a GPU without fp8 tensor cores (below compute capability 8.9) the weights stay fp8 in
        memory and every GEMM dequantizes them (W8A16; logged as a warning)
  int4  groups of 128 along K, symmetric (scale = amax / 7, round to nearest): the W4A16 kernels

The block / group is 128 where it divides every width a weight is cut at (fused q/k/v and gate/up rows, the in
features); else the largest of 64, 32, 16 that does (logged). A width no 16-wide block divides is refused.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import List, Optional

import torch

from moe_infer.models.arch import ModelArch
from moe_infer.quant import ONLINE_METHODS, QuantSpec

logger = logging.getLogger(__name__)

PREFERRED_BLOCK = 128


def split_widths(arch: ModelArch) -> List[int]:
    """Every in-features width and every row offset a quantized weight is filled at (q/k/v, gate/up halves)."""
    widths = [arch.hidden_size]
    if arch.moe_layer_ids:
        widths.append(arch.moe_intermediate_size)
    if len(arch.moe_layer_ids) < arch.num_layers:
        widths.append(arch.intermediate_size)
    if arch.shared_expert_intermediate_size:
        widths.append(arch.shared_expert_intermediate_size)
    mla = arch.mla
    if mla is None:
        widths += [arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim]
    else:
        widths += [mla.kv_lora_rank, arch.num_heads * mla.v_head_dim] + ([mla.q_lora_rank] if mla.q_lora_rank else [])
    return widths


def online_quant_spec(method: str, arch: ModelArch, device: Optional[torch.device] = None) -> QuantSpec:
    if method not in ONLINE_METHODS:
        raise ValueError(f"quantization={method!r} is not supported: one of {list(ONLINE_METHODS)} (a bf16 checkpoint "
                         f"quantized at load), or None (the checkpoint's own format)")
    g = math.gcd(*split_widths(arch))
    block = next((b for b in (128, 64, 32, 16) if g % b == 0), None)
    if block is None:
        raise ValueError(f"quantization={method!r}: the model's widths {split_widths(arch)} have no common 16-wide "
                         f"block (gcd {g}); this model cannot be quantized at load")
    if block != PREFERRED_BLOCK:
        logger.warning("quantization=%s: blocks / groups of %d (128 does not divide the widths %s)", method, block,
                       split_widths(arch))
    if method == "int4":
        return QuantSpec("int4", group_size=block, symmetric=True, online=True)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        logger.warning("quantization=fp8 on a GPU of compute capability %s (no fp8 tensor cores below 8.9): the "
                       "weights are stored in fp8 and dequantized per GEMM (W8A16)",
                       torch.cuda.get_device_capability(dev))
    return QuantSpec("fp8", block, block, online=True)


def with_online_quant(arch: ModelArch, method: Optional[str], device=None) -> ModelArch:
    """arch with its weights quantized at load by `method` (None: unchanged). A checkpoint that is already quantized
    is refused unless method names its own format (then nothing changes)."""
    if method is None:
        return arch
    if arch.quant is not None:
        if method == arch.quant.method:
            return arch
        raise ValueError(f"quantization={method!r}: the checkpoint is already quantized ({arch.quant.method}); "
                         f"load it without quantization= (or with quantization={arch.quant.method!r})")
    return dataclasses.replace(arch, quant=online_quant_spec(method, arch, device))
