"""The two 4-bit weight formats the W4A16 kernels read, in plain PyTorch: packing, quantization, dequantization.

int4 group-wise (GPTQ / compressed-tensors "pack-quantized"):
    packed int32 [..., N, K / 8]: value j of a word at bits 4j..4j+3 (little-endian nibbles along K), each an
        unsigned code u in [0, 15] (compressed-tensors stores the signed q in [-8, 7] as u = q + 8)
    scale [..., N, K / group] (bf16 / fp16 / fp32), zero uint8 [..., N, K / group] (unsigned codes, None: 8)
    w[n, k] = (u[n, k] - zero[n, k // group]) * scale[n, k // group]
mxfp4 (OCP microscaling, GPT-OSS's experts):
    packed uint8 [..., N, K / 2]: value 2i in the low nibble, 2i + 1 in the high one, each an e2m1 code
        (sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives)
    scale uint8 [..., N, K / 32]: e8m0, 2 ** (s - 127)
    w[n, k] = e2m1(code[n, k]) * 2 ** (scale[n, k // 32] - 127)

Quantizers: `quantize_int4` (round to nearest, symmetric: scale = amax / 7 with codes clamped to [-8, 7] + 8;
asymmetric: [min, max] over 16 steps), `quantize_mxfp4` (OCP's rule: the shared exponent floor(log2 amax) - 2, each
value rounded to the nearest e2m1 value, ties to even, saturating at 6). Used to quantize a bf16 checkpoint at load.

Legend: N rows (out features), K columns (in features, the packed dim), G = K / group scale groups.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

INT4_PER_WORD = 8
MXFP4_GROUP = 32
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., N, K] in [0, 15] -> int32 [..., N, K / 8] (value j of a word at bits 4j)."""
    K = codes.shape[-1]
    _check(K % INT4_PER_WORD == 0, f"K={K} must be a multiple of {INT4_PER_WORD} to pack int4 values into int32")
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], K // INT4_PER_WORD, INT4_PER_WORD)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    word = (c << shifts).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., N, K / 8] -> uint8 codes [..., N, K]."""
    _check(packed.dtype == torch.int32, f"packed int4 weights must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    codes = (packed[..., None] >> shifts) & 0xF
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * INT4_PER_WORD).to(torch.uint8)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], group: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [..., N, K] in dtype (computed in float32)."""
    codes = unpack_int4(packed).float()
    K = codes.shape[-1]
    _check(K % group == 0 and scale.shape[-1] == K // group, f"scale {tuple(scale.shape)} does not give one value "
           f"per group of {group} of K={K}")
    s = scale.float().repeat_interleave(group, -1)
    z = 8.0 if zero is None else zero.float().repeat_interleave(group, -1)
    return ((codes - z) * s).to(dtype)


def quantize_int4(w: torch.Tensor, group: int, symmetric: bool = True, scale_dtype: torch.dtype = torch.bfloat16
                  ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(packed int32 [..., N, K / 8], scale [..., N, G] scale_dtype, zero uint8 [..., N, G] or None) of w [..., N, K]:
    round to nearest over each group of `group` values along K (scales rounded to scale_dtype first, so the codes
    fit the scale that is stored)."""
    K = w.shape[-1]
    _check(group % INT4_PER_WORD == 0 and K % group == 0, f"K={K} must be a multiple of the group size {group}, "
           f"itself a multiple of {INT4_PER_WORD}")
    g = w.float().reshape(*w.shape[:-1], K // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.0).clamp_min(1e-10).to(scale_dtype)
        codes = (g / scale.float()[..., None]).round().clamp(-8, 7) + 8
        zero = None
    else:
        lo, hi = g.amin(-1).clamp_max(0.0), g.amax(-1).clamp_min(0.0)
        scale = ((hi - lo) / 15.0).clamp_min(1e-10).to(scale_dtype)
        zero_f = (-lo / scale.float()).round().clamp(0, 15)
        codes = (g / scale.float()[..., None] + zero_f[..., None]).round().clamp(0, 15)
        zero = zero_f.to(torch.uint8)
    return pack_int4(codes.reshape(w.shape).to(torch.uint8)), scale, zero


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [..., N, K] in dtype from packed uint8 [..., N, K / 2] and e8m0 scales uint8 [..., N, K / 32]."""
    _check(packed.dtype == torch.uint8 and scale.dtype == torch.uint8,
           f"mxfp4 weights and scales must be uint8, got {packed.dtype}, {scale.dtype}")
    K = packed.shape[-1] * 2
    _check(scale.shape[-1] * MXFP4_GROUP == K, f"mxfp4 scale {tuple(scale.shape)} must hold one value per "
           f"{MXFP4_GROUP} of K={K}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(*packed.shape[:-1], K)
    s = torch.exp2(scale.float() - E8M0_BIAS).repeat_interleave(MXFP4_GROUP, -1)
    return (lut[codes.long()] * s).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., N, K / 2], e8m0 scales uint8 [..., N, K / 32]) of w [..., N, K]."""
    K = w.shape[-1]
    _check(K % MXFP4_GROUP == 0, f"K={K} must be a multiple of {MXFP4_GROUP} for mxfp4")
    g = w.float().reshape(*w.shape[:-1], K // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(-1)
    exp = torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2  # e2m1's largest exponent is 2 (6 = 1.5 * 4)
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    v = g / torch.exp2(exp)[..., None]
    del g
    # the nearest e2m1 magnitude's index: how many of the midpoints between neighbours |v| passes. A tie goes to the
    # even index (its mantissa bit 0: OCP's round-to-nearest-even), so a midpoint above an even index must be passed
    # (>) and one above an odd index reached (>=). One byte a value: GPT-OSS's experts quantize in bounded memory.
    a = v.abs()
    idx = torch.zeros(a.shape, dtype=torch.uint8, device=w.device)
    mags = E2M1_VALUES[:8]
    for i in range(7):
        mid = (mags[i] + mags[i + 1]) / 2
        idx += (a >= mid) if i % 2 else (a > mid)
    del a
    idx += (v < 0) * 8
    codes = idx.reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp + E8M0_BIAS).to(torch.uint8)
