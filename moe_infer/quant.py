"""Quantized weights: a checkpoint's format, carried by the weight itself.

A quantized weight is a Parameter of the stored dtype (float8_e4m3fn, or uint8 packed codes) whose `quant` attribute
says how to read it (`BlockFp8`: one float32 scale per block_n x block_k block, DeepSeek-V3's and Qwen3's FP8
releases, `weight_scale_inv` in the checkpoint; `Mxfp4`: two e2m1 codes a byte and an e8m0 scale per 32 values,
GPT-OSS's experts, `*_blocks` / `*_scales`). Its scale tensor is a buffer of the owning module beside the weight
(`<name>_scale_inv`; mxfp4: `<name>_scales`), so the loader fills both and the weight never exists in bf16 in
memory. `linear` (layers/linear.py) and the experts backends dispatch on it: a W8A8 kernel with per-token-group (1 x
block_k) activation quantization where FP8_LINEAR_KERNELS has one for the device (Hopper:
`moe_infer.layers.quant_triton`), else the weight dequantized for the call (W8A16: the CPU, older GPUs; logged
once). mxfp4 covers the routed experts only (`QuantSpec.quantizes_linear` False): their backends dequantize each
expert for the call (`expert_weight`) until a W4A16 grouped kernel takes the format.

`QuantSpec` is the checkpoint's `quantization_config`, parsed into ModelArch.quant; layers build their quantizable
weights through `make_linear` / `quantized_param`: every linear weight of the decoder layers (attention, dense and
shared MLPs, experts) except the MoE routers, the embedding and the LM head (a `modules_to_not_convert` naming
anything else is refused: unquantized layers among quantized ones are not built).

Legend: N out features, K in features, E experts, Nb = ceil(N / block_n), Kb = ceil(K / block_k).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_infer.registry import Registry

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's quantization: method "fp8" with block_n x block_k weight blocks, dynamic activations; or
    "mxfp4" (GPT-OSS: the routed experts only, e2m1 values with an e8m0 scale per 32 along K: block 1 x 32)."""

    method: str
    block_n: int
    block_k: int

    def scale_shape(self, n: int, k: int) -> Tuple[int, int]:
        return -(-n // self.block_n), -(-k // self.block_k)

    @property
    def quantizes_linear(self) -> bool:
        """Whether the dense linear layers (attention, dense and shared MLPs) are quantized too, not only experts."""
        return self.method == "fp8"

    def weight_tensors(self, n: int, k: int) -> Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]:
        """The tensors one weight [N, K] of this format is stored as: (name suffix, shape, dtype), the data first
        (suffix ""), then its scales under the checkpoint's suffix. What the offload tiers allocate, move and
        slot (moe_infer/offload/layout.py) for each expert: a new format describes its tensors here."""
        if self.method == "fp8":
            return ("", (n, k), FP8), ("_scale_inv", self.scale_shape(n, k), torch.float32)
        raise NotImplementedError(f"quant_method={self.method!r} does not describe its tensors")

    def attach(self, data: torch.Tensor, tensors: Dict[str, torch.Tensor]) -> torch.Tensor:
        """`data` ([..., N, K], the weight_tensors "" entry) carrying its format, read from the other entries
        (`tensors`: suffix -> tensor of the same leading dims): what kernels and dequantization dispatch on."""
        if self.method == "fp8":
            data.quant = BlockFp8(tensors["_scale_inv"], self.block_n, self.block_k)
            return data
        raise NotImplementedError(f"quant_method={self.method!r} cannot attach its format")


def linear_quant(quant: Optional[QuantSpec]) -> Optional[QuantSpec]:
    """The spec a dense linear layer is built with: quant where it covers dense layers, else None (unquantized)."""
    return quant if quant is not None and quant.quantizes_linear else None


def parse_quant(cfg: Any) -> Optional[QuantSpec]:
    """The QuantSpec of a transformers config (None: unquantized); a format not built yet is refused by name."""
    qcfg = getattr(cfg, "quantization_config", None)
    if not qcfg:
        return None
    get = qcfg.get if isinstance(qcfg, dict) else (lambda key, default=None: getattr(qcfg, key, default))
    method = get("quant_method", "?")
    if method == "mxfp4":
        experts = [s for s in get("modules_to_not_convert", None) or () if "experts" in s]
        if experts:
            raise NotImplementedError(f"mxfp4 checkpoint with modules_to_not_convert {experts[:5]}: unquantized "
                                      f"experts among mxfp4 ones are not supported")
        return QuantSpec("mxfp4", 1, MXFP4_BLOCK)
    if method != "fp8":
        raise NotImplementedError(f"quantized checkpoints of quant_method={method!r} are not supported yet (fp8 with "
                                  f"block scales and GPT-OSS's mxfp4 are): use the checkpoint's bf16 release")
    block = get("weight_block_size", None)
    if not block or len(block) != 2:
        raise NotImplementedError("fp8 checkpoints without weight_block_size (per-tensor or per-channel scales) are "
                                  "not supported yet: only DeepSeek-style block scales (weight_block_size [128, 128])")
    if get("activation_scheme", "dynamic") != "dynamic":
        raise NotImplementedError(f"fp8 activation_scheme={get('activation_scheme')!r}: only 'dynamic' is supported")
    if get("fmt", "e4m3") != "e4m3":
        raise NotImplementedError(f"fp8 fmt={get('fmt')!r}: only e4m3 is supported")
    never = ("lm_head", "embed_tokens", "gate")  # the modules this engine never quantizes
    other = [s for s in get("modules_to_not_convert", None) or () if not any(s == n or s.endswith("." + n)
                                                                               for n in never)]
    if other:
        raise NotImplementedError(f"fp8 checkpoint with modules_to_not_convert {other[:5]}: unquantized layers among "
                                  f"quantized ones are not supported yet")
    return QuantSpec("fp8", int(block[0]), int(block[1]))


class BlockFp8:
    """The format of an fp8 weight [..., N, K] with float32 scales [..., Nb, Kb] (scale_inv: the checkpoint's name;
    the dequantized weight is w * scale)."""

    def __init__(self, scale_inv: torch.Tensor, block_n: int, block_k: int) -> None:
        self.scale_inv, self.block_n, self.block_k = scale_inv, block_n, block_k

    def dequantize(self, w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in dtype (computed in float32)."""
        n, k = w.shape[-2:]
        scale = self.scale_inv.repeat_interleave(self.block_n, -2)[..., :n, :]
        scale = scale.repeat_interleave(self.block_k, -1)[..., :k]
        return (w.float() * scale).to(dtype)

    def select(self, e: int) -> "BlockFp8":
        """The format of expert e's weight of a stacked [E, N, K]."""
        return BlockFp8(self.scale_inv[e], self.block_n, self.block_k)

    def __repr__(self) -> str:
        return f"BlockFp8(block {self.block_n}x{self.block_k}, scales {tuple(self.scale_inv.shape)})"


MXFP4_BLOCK = 32  # values sharing one e8m0 scale, along K
# e2m1 codes 0..15 (sign bit 3, two exponent bits, one mantissa bit) -> value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4:
    """The format of an mxfp4 weight [..., N, K / 2] uint8 (two e2m1 codes a byte: element 2j in the low nibble,
    2j + 1 in the high one) with uint8 e8m0 scales [..., N, K / 32] (the value is code * 2^(scale - 127)): the
    OCP microscaling format as GPT-OSS's checkpoints store it (`*_blocks` [..., N, K / 32, 16], `*_scales`)."""

    def __init__(self, scales: torch.Tensor) -> None:
        self.scales = scales

    def select(self, e: int) -> "Mxfp4":
        return Mxfp4(self.scales[e])

    def dequantize(self, w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [..., N, K] in dtype (exact: every value is a power of two times an e2m1 value)."""
        return mxfp4_dequantize(w, self.scales, dtype)

    def __repr__(self) -> str:
        return f"Mxfp4(block {MXFP4_BLOCK}, scales {tuple(self.scales.shape)})"


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [..., N, K / 2] uint8 and e8m0 scales [..., N, K / 32] uint8 -> [..., N, K] in dtype (the PyTorch
    reference of the mxfp4 kernels)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 weights and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    *lead, n, half = blocks.shape
    k = 2 * half
    if tuple(scales.shape) != (*lead, n, k // MXFP4_BLOCK) or k % MXFP4_BLOCK:
        raise ValueError(f"mxfp4 scales {tuple(scales.shape)} do not fit weights {tuple(blocks.shape)} "
                         f"(one scale a {MXFP4_BLOCK} values)")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*lead, n, k)
    values = lut[codes.long()].view(*lead, n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = torch.exp2(scales.float() - 127.0)[..., None]
    return (values * scale).reshape(*lead, n, k).to(dtype)


# (x_TK, w_NK fp8, scale_inv [Nb, Kb], block_n, block_k) -> y_TN in x's dtype, or None where the kernel cannot run
Fp8LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], Optional[torch.Tensor]]
FP8_LINEAR_KERNELS: Registry[Fp8LinearFn] = Registry("fp8 linear kernel")
_fallback_logged: set = set()


def quantized_param(module: nn.Module, name: str, shape: Tuple[int, ...], spec: QuantSpec) -> nn.Parameter:
    """module.<name> becomes a quantized Parameter of the logical `shape` ([..., N, K]) with its scale buffer: fp8
    [..., N, K] with <name>_scale_inv, or mxfp4 uint8 [..., N, K / 2] with <name>_scales uint8 [..., N, K / 32]."""
    n, k = shape[-2:]
    if spec.method == "mxfp4":
        if k % MXFP4_BLOCK:
            raise ValueError(f"mxfp4 weight {name}: K={k} is not a multiple of {MXFP4_BLOCK}")
        scales = torch.empty(*shape[:-2], n, k // MXFP4_BLOCK, dtype=torch.uint8)
        weight = nn.Parameter(torch.empty(*shape[:-2], n, k // 2, dtype=torch.uint8), requires_grad=False)
        weight.quant = Mxfp4(scales)
        if name in module._parameters:
            del module._parameters[name]
        setattr(module, name, weight)
        module.register_buffer(f"{name}_scales", scales)
        return weight
    scale = torch.empty(*shape[:-2], *spec.scale_shape(n, k), dtype=torch.float32)
    weight = nn.Parameter(torch.empty(shape, dtype=FP8), requires_grad=False)
    weight.quant = BlockFp8(scale, spec.block_n, spec.block_k)
    if name in module._parameters:
        del module._parameters[name]
    setattr(module, name, weight)
    module.register_buffer(f"{name}_scale_inv", scale)
    return weight


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                quant: Optional[QuantSpec] = None) -> nn.Linear:
    """nn.Linear(in, out, bias, dtype); with quant (one that covers dense layers: fp8) its weight is fp8 (block
    scales), never allocated in dtype."""
    quant = linear_quant(quant)
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device="meta")
    quantized_param(layer, "weight", (out_features, in_features), quant)
    if bias:
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
    return layer


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x W^T (+ bias) for an fp8 weight: a registered W8A8 kernel where it runs, else W8A16 (dequantized)."""
    q: BlockFp8 = weight.quant
    for name in FP8_LINEAR_KERNELS.names():
        y = FP8_LINEAR_KERNELS.get(name)(x, weight, q.scale_inv, q.block_n, q.block_k)
        if y is not None:
            return y if bias is None else y + bias
    key = (x.device.type, x.dtype)
    if key not in _fallback_logged:
        _fallback_logged.add(key)
        logger.info("fp8 linear layers on %s run with their weights dequantized per call (no W8A8 kernel there)",
                    x.device)
    return F.linear(x, q.dequantize(weight, x.dtype), bias)


def expert_weight(w_ENK: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's weight [N, K] of a stacked [E, N, K] in dtype (dequantized where it carries a format)."""
    q = getattr(w_ENK, "quant", None)
    if q is None:
        return w_ENK[e].to(dtype)
    return q.select(e).dequantize(w_ENK[e], dtype)


def dequantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in dtype: dequantized where it carries a format, else cast."""
    q = getattr(weight, "quant", None)
    return q.dequantize(weight, dtype) if q is not None else weight.to(dtype)
