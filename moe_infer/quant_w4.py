"""The two 4-bit weight formats a quantized weight carries (moe_infer/quant.py): `Int4Group` (group-wise int4) and
`Mxfp4` (OCP microscaling, GPT-OSS's experts). Their bit layouts, quantizers and dequantizers are those of
kernels/w4_format.py, which the W4A16 kernels read.

Legend: N out features, K in features.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_infer.kernels.w4_format import E2M1_VALUES, dequantize_int4, quantize_int4

MXFP4_BLOCK = 32  # values sharing one e8m0 scale, along K


class Mxfp4:
    """The format of an mxfp4 weight [..., N, K / 2] uint8 (two e2m1 codes a byte: element 2j in the low nibble,
    2j + 1 in the high one) with uint8 e8m0 scales [..., N, K / 32] (the value is code * 2^(scale - 127)): the
    OCP microscaling format as GPT-OSS's checkpoints store it (`*_blocks` [..., N, K / 32, 16], `*_scales`). The
    nibble order and e8m0 scale are those of kernels/w4_format.py, so the W4A16 kernel reads `.scale` as it is."""

    fmt = "mxfp4"
    group_size = MXFP4_BLOCK
    zero = None

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale

    def select(self, e: int) -> "Mxfp4":
        return Mxfp4(self.scale[e])

    def dequantize(self, w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [..., N, K] in dtype (exact: every value is a power of two times an e2m1 value)."""
        return mxfp4_dequantize(w, self.scale, dtype)

    def __repr__(self) -> str:
        return f"Mxfp4(block {MXFP4_BLOCK}, scales {tuple(self.scale.shape)})"


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


class Int4Group:
    """The format of an int4 weight [..., N, K] stored packed int32 [..., N, K / 8] (kernels/w4_format.py), with a
    scale [..., N, K / group_size] and, asymmetric, a uint8 zero point per group (None: 8)."""

    fmt = "int4"

    def __init__(self, scale: torch.Tensor, zero: Optional[torch.Tensor], group_size: int) -> None:
        self.scale, self.zero, self.group_size = scale, zero, group_size

    def dequantize(self, w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(w, self.scale, self.zero, self.group_size, dtype)

    def select(self, e: int) -> "Int4Group":
        return Int4Group(self.scale[e], None if self.zero is None else self.zero[e], self.group_size)

    def store(self, w: torch.Tensor, idx: tuple, src: torch.Tensor) -> None:
        """w[idx] <- src [..., n, k] quantized round to nearest (online); idx indexes leading dims and rows."""
        packed, scale, zero = quantize_int4(src, self.group_size, self.zero is None, self.scale.dtype)
        w[idx].copy_(packed)
        self.scale[idx].copy_(scale)
        if self.zero is not None:
            self.zero[idx].copy_(zero)

    def __repr__(self) -> str:
        kind = "symmetric" if self.zero is None else "with zero points"
        return f"Int4Group(group {self.group_size}, {kind}, scales {tuple(self.scale.shape)})"
