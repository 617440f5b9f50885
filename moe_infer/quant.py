"""Quantized weights: a checkpoint's format, carried by the weight itself.

A quantized weight is a Parameter of the stored dtype whose `quant` attribute says how to read it (its `fmt`):
  `BlockFp8`   "fp8_block": float8_e4m3fn [..., N, K], one float32 scale per block_n x block_k block (DeepSeek-V3's
               and Qwen3's FP8 releases, `weight_scale_inv` in the checkpoint; also `quantization="fp8"` of a bf16
               checkpoint)
  `Int4Group`  "int4": int4 codes packed 8 per int32 along K, [..., N, K / 8], a scale per group of K (bf16 / fp16)
               and, asymmetric, a uint8 zero point per group (compressed-tensors "pack-quantized" W4A16 checkpoints;
               `quantization="int4"`, group 128 symmetric, of a bf16 checkpoint); layout in kernels/w4_format.py
  `Mxfp4`      "mxfp4": two e2m1 codes a byte, uint8 [..., N, K / 2], and a uint8 e8m0 scale per 32 values along K,
               `.scale` [..., N, K / 32] (GPT-OSS's experts, `*_blocks` / `*_scales` in the checkpoint)
Its scale tensors are buffers of the owning module beside the weight (`<name>_scale_inv`; `<name>_scale`,
`<name>_zero`; mxfp4: `<name>_scales`), so the loader fills them and the weight never exists in bf16 in memory.
`linear` (layers/linear.py) and the experts backends dispatch on it: a W8A8 kernel with per-token-group (1 x
block_k) activation quantization where FP8_LINEAR_KERNELS has one for the device (Hopper:
`moe_infer.layers.quant_triton`), else the weight dequantized for the call (W8A16: the CPU, older GPUs; logged
once). An int4 dense weight is dequantized per call on the CPU, through the W4A16 GEMM of
`moe_infer.kernels.fused_moe_w4a16` on CUDA (W4_LINEAR_KERNELS, registered by `moe_infer.layers.quant_triton`).
mxfp4 covers the routed experts only (`QuantSpec.quantizes_linear` False). The experts run
`moe_infer.kernels.fused_moe_w4a16` for int4 and mxfp4 (`experts/triton_experts.py` dispatches on `fmt`), GPT-OSS's
biases and clamped SwiGLU included (kernels/moe_epilogue.py); the formats themselves live in quant_w4.py.

Online quantization (`online_quant_spec`, `LLM(..., quantization="fp8" | "int4")`, vLLM's names): the model is built
with quantized weights and the loader quantizes each bf16 checkpoint tensor as it is read (`store_quantized`).

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

from moe_infer.quant_w4 import MXFP4_BLOCK, Int4Group, Mxfp4, mxfp4_dequantize  # noqa: F401 (the formats' home)
from moe_infer.registry import Registry

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


ONLINE_METHODS = ("fp8", "int4")  # quantization= names that quantize a bf16 checkpoint at load


@dataclass(frozen=True)
class QuantSpec:
    """The weights' quantization: method "fp8" with block_n x block_k weight blocks (dynamic activations), "int4"
    with groups of group_size along K (symmetric, or with zero points), or "mxfp4" (GPT-OSS: the routed experts only,
    e2m1 values with an e8m0 scale per 32 along K: block 1 x 32). online: a bf16 checkpoint quantized at load."""

    method: str
    block_n: int = 0
    block_k: int = 0
    group_size: int = 0
    symmetric: bool = True
    online: bool = False

    def __post_init__(self) -> None:
        if self.method == "fp8" and (self.block_n < 1 or self.block_k < 1):
            raise ValueError(f"fp8 QuantSpec needs block_n and block_k, got {self}")
        if self.method == "int4" and (self.group_size < 8 or self.group_size % 8):
            raise ValueError(f"int4 QuantSpec needs a group_size that is a multiple of 8, got {self}")
        if self.method not in ("fp8", "int4", "mxfp4"):
            raise ValueError(f"unknown QuantSpec method {self.method!r}")

    def scale_shape(self, n: int, k: int) -> Tuple[int, int]:
        if self.method == "int4":
            return n, -(-k // self.group_size)
        return -(-n // self.block_n), -(-k // self.block_k)

    @property
    def quantizes_linear(self) -> bool:
        """Whether the dense linear layers (attention, dense and shared MLPs) are quantized too, not only experts."""
        return self.method in ("fp8", "int4")

    def weight_tensors(self, n: int, k: int, dtype: torch.dtype = torch.bfloat16
                       ) -> Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]:
        """The tensors one weight [N, K] of this format is stored as: (name suffix, shape, dtype), the data first
        (suffix ""), then its scales under the checkpoint's suffix (as `quantized_param` names them; dtype: the
        model's, int4's scale dtype). What the offload tiers allocate, move and slot (moe_infer/offload/layout.py)
        for each expert: a new format describes its tensors here."""
        if self.method == "fp8":
            return ("", (n, k), FP8), ("_scale_inv", self.scale_shape(n, k), torch.float32)
        if self.method == "int4":
            out = (("", (n, k // 8), torch.int32), ("_scale", self.scale_shape(n, k), dtype))
            return out if self.symmetric else out + (("_zero", self.scale_shape(n, k), torch.uint8),)
        return ("", (n, k // 2), torch.uint8), ("_scales", (n, k // MXFP4_BLOCK), torch.uint8)

    def attach(self, data: torch.Tensor, tensors: Dict[str, torch.Tensor]) -> torch.Tensor:
        """`data` ([..., N, K], the weight_tensors "" entry) carrying its format, read from the other entries
        (`tensors`: suffix -> tensor of the same leading dims): what kernels and dequantization dispatch on."""
        if self.method == "fp8":
            data.quant = BlockFp8(tensors["_scale_inv"], self.block_n, self.block_k)
        elif self.method == "int4":
            data.quant = Int4Group(tensors["_scale"], tensors.get("_zero"), self.group_size)
        else:
            data.quant = Mxfp4(tensors["_scales"])
        return data


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
    if method == "compressed-tensors":
        return _parse_compressed_tensors(get)
    if method != "fp8":
        raise NotImplementedError(f"quantized checkpoints of quant_method={method!r} are not supported yet (fp8 with "
                                  f"block scales, GPT-OSS's mxfp4 and compressed-tensors W4A16 pack-quantized are): "
                                  f"use the checkpoint's bf16 release, or quantization='int4' / 'fp8' on it")
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


_NEVER_QUANTIZED = ("lm_head", "gate", "embed_tokens")  # what this engine never quantizes (ignore lists may name them)


def _parse_compressed_tensors(get) -> QuantSpec:
    """compressed-tensors "pack-quantized" W4A16: one config group of 4-bit int weights in groups along K,
    symmetric, no activation quantization; its ignore list may name only the LM head and the routers."""
    fmt = get("format", None)
    groups = get("config_groups", None) or {}
    if fmt != "pack-quantized" or len(groups) != 1:
        raise NotImplementedError(f"compressed-tensors checkpoint of format {fmt!r} with {len(groups)} config groups: "
                                  f"only one 'pack-quantized' group (W4A16) is supported")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (4, "int", "group") or group.get("input_activations"):
        raise NotImplementedError(f"compressed-tensors weights {w} with activations "
                                  f"{group.get('input_activations')}: only 4-bit int group-wise weights (W4A16)")
    if not w.get("symmetric", True):
        raise NotImplementedError("compressed-tensors checkpoints with zero points (asymmetric) are not supported yet")
    other = [s for s in get("ignore", None) or () if not any(n in s for n in _NEVER_QUANTIZED)]
    if other:
        raise NotImplementedError(f"compressed-tensors checkpoint ignoring {other[:5]}: unquantized layers among "
                                  f"quantized ones are not supported yet")
    return QuantSpec("int4", group_size=int(w["group_size"]), symmetric=True)


class BlockFp8:
    """The format of an fp8 weight [..., N, K] with float32 scales [..., Nb, Kb] (scale_inv: the checkpoint's name;
    the dequantized weight is w * scale)."""

    fmt = "fp8_block"

    def __init__(self, scale_inv: torch.Tensor, block_n: int, block_k: int) -> None:
        self.scale_inv, self.block_n, self.block_k = scale_inv, block_n, block_k

    def dequantize(self, w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in dtype (computed in float32)."""
        n, k = w.shape[-2:]
        scale = self.scale_inv.repeat_interleave(self.block_n, -2)[..., :n, :]
        scale = scale.repeat_interleave(self.block_k, -1)[..., :k]
        return (w.float() * scale).to(dtype)

    def select(self, e: int) -> "BlockFp8":
        """The format of expert e's weight w[e] of a stacked [E, N, K]."""
        return BlockFp8(self.scale_inv[e], self.block_n, self.block_k)

    def store(self, w: torch.Tensor, idx: tuple, src: torch.Tensor) -> None:
        """w[idx] <- src [..., n, k] quantized (online): idx indexes leading dims and rows, rows in whole blocks."""
        q, scale = quantize_block_fp8(src, self.block_n, self.block_k)
        w[idx].copy_(q)
        self.scale_inv[_rows_in_blocks(idx, w.dim(), self.block_n)].copy_(scale)

    def __repr__(self) -> str:
        return f"BlockFp8(block {self.block_n}x{self.block_k}, scales {tuple(self.scale_inv.shape)})"


def quantize_block_fp8(w: torch.Tensor, block_n: int, block_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [..., N, K], float32 scales [..., Nb, Kb]) of w: each block's amax maps to 448 (partial last blocks)."""
    n, k = w.shape[-2:]
    nb, kb = -(-n // block_n), -(-k // block_k)
    padded = F.pad(w.float(), (0, kb * block_k - k, 0, nb * block_n - n))
    blocks = padded.reshape(*w.shape[:-2], nb, block_n, kb, block_k)
    scale = (blocks.abs().amax(dim=(-3, -1)) / E4M3_MAX).clamp_min(1e-12)
    q = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.reshape(*w.shape[:-2], nb * block_n, kb * block_k)[..., :n, :k], scale


def _rows_in_blocks(idx: tuple, ndim: int, block: int) -> tuple:
    """An index of a weight's leading dims and rows as the index of its block scales (rows in whole blocks)."""
    out = []
    for dim, ix in enumerate(idx):
        if dim == ndim - 2 and isinstance(ix, slice) and ix != slice(None):
            start, stop = ix.start or 0, ix.stop
            if start % block or (stop is not None and stop % block):
                raise ValueError(f"rows [{ix.start}, {ix.stop}) of a weight cut its {block}-row fp8 scale blocks")
            ix = slice(start // block, None if stop is None else -(-stop // block))
        out.append(ix)
    return tuple(out)


# (x_TK, w_NK fp8, scale_inv [Nb, Kb], block_n, block_k) -> y_TN in x's dtype, or None where the kernel cannot run
Fp8LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], Optional[torch.Tensor]]
FP8_LINEAR_KERNELS: Registry[Fp8LinearFn] = Registry("fp8 linear kernel")
# (x_TK, w packed, format object) -> y_TN in x's dtype, or None where the kernel cannot run (a W4A16 GEMM)
W4_LINEAR_KERNELS: Registry[Callable[[torch.Tensor, torch.Tensor, Any], Optional[torch.Tensor]]] = Registry(
    "4-bit linear kernel")
_fallback_logged: set = set()


def quantized_param(module: nn.Module, name: str, shape: Tuple[int, ...], spec: QuantSpec,
                    dtype: torch.dtype = torch.bfloat16) -> nn.Parameter:
    """module.<name> becomes a quantized Parameter of logical `shape` ([..., N, K]) with its scale buffers: fp8 with
    <name>_scale_inv, or int4 packed [..., N, K / 8] with <name>_scale (dtype; float32 stays float32, other dtypes
    bf16 or fp16 as given) and, asymmetric, <name>_zero; or mxfp4 uint8 [..., N, K / 2] with <name>_scales uint8
    [..., N, K / 32]."""
    n, k = shape[-2:]
    lead = shape[:-2]
    if name in module._parameters:
        del module._parameters[name]
    if spec.method == "mxfp4":
        if k % MXFP4_BLOCK:
            raise ValueError(f"mxfp4 weight {name}: K={k} is not a multiple of {MXFP4_BLOCK}")
        scales = torch.empty(*lead, n, k // MXFP4_BLOCK, dtype=torch.uint8)
        weight = nn.Parameter(torch.empty(*lead, n, k // 2, dtype=torch.uint8), requires_grad=False)
        weight.quant = Mxfp4(scales)
        setattr(module, name, weight)
        module.register_buffer(f"{name}_scales", scales)
        return weight
    if spec.method == "int4":
        if k % spec.group_size:
            raise ValueError(f"int4 weight {name} {list(shape)}: in features {k} are not a multiple of the group size "
                             f"{spec.group_size}")
        weight = nn.Parameter(torch.empty(*lead, n, k // 8, dtype=torch.int32), requires_grad=False)
        scale = torch.empty(*lead, *spec.scale_shape(n, k), dtype=dtype)
        zero = None if spec.symmetric else torch.empty(*lead, *spec.scale_shape(n, k), dtype=torch.uint8)
        weight.quant = Int4Group(scale, zero, spec.group_size)
        setattr(module, name, weight)
        module.register_buffer(f"{name}_scale", scale)
        if zero is not None:
            module.register_buffer(f"{name}_zero", zero)
        return weight
    scale = torch.empty(*lead, *spec.scale_shape(n, k), dtype=torch.float32)
    weight = nn.Parameter(torch.empty(shape, dtype=FP8), requires_grad=False)
    weight.quant = BlockFp8(scale, spec.block_n, spec.block_k)
    setattr(module, name, weight)
    module.register_buffer(f"{name}_scale_inv", scale)
    return weight


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                quant: Optional[QuantSpec] = None) -> nn.Linear:
    """nn.Linear(in, out, bias, dtype); with quant (one that covers dense layers: fp8, int4) its weight is quantized
    (fp8 block scales or int4 groups), never allocated in dtype."""
    quant = linear_quant(quant)
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device="meta")
    quantized_param(layer, "weight", (out_features, in_features), quant, dtype)
    if bias:
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
    return layer


def is_quantized(weight: torch.Tensor) -> bool:
    return getattr(weight, "quant", None) is not None


def linear_quantized(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x W^T (+ bias) for a weight that carries its format."""
    if weight.quant.fmt == "fp8_block":
        return linear_fp8(x, weight, bias)
    for name in W4_LINEAR_KERNELS.names():
        y = W4_LINEAR_KERNELS.get(name)(x, weight, weight.quant)
        if y is not None:
            return y if bias is None else y + bias
    key = (weight.quant.fmt, x.device.type, x.dtype)
    if key not in _fallback_logged:
        _fallback_logged.add(key)
        logger.info("%s dense layers on %s run with their weights dequantized per call (no W4A16 kernel there)",
                    weight.quant.fmt, x.device)
    return F.linear(x, weight.quant.dequantize(weight, x.dtype), bias)


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


def logical_shape(weight: torch.Tensor) -> Tuple[int, ...]:
    """The weight's [..., N, K] (an int4 weight's K is 8 times its packed last dim)."""
    q = getattr(weight, "quant", None)
    if q is not None and q.fmt == "int4":
        return (*weight.shape[:-1], weight.shape[-1] * 8)
    if q is not None and q.fmt == "mxfp4":
        return (*weight.shape[:-1], weight.shape[-1] * 2)
    return tuple(weight.shape)
