"""`model.load_format=dummy`: random weights for a model built from config.json alone (vLLM's
`--load-format dummy`), for benchmarks of shapes whose checkpoint is not at hand.

Norm weights are 1, every other tensor uniform in +-1/sqrt(fan_in) (routers then pick by margins
a real model would have). A quantized weight (moe_infer/quant.py) gets fp8 values uniform over e4m3's range and
every block scale bound / 448, so that it dequantizes to the same spread; an int4 one random codes and scales
bound / 8; an mxfp4 one random e2m1 codes and a power-of-two scale with 6 x scale about the bound. Large tensors
(offloaded experts run to tens of GiB) are filled by repeating one random block, which is memory-bound instead of
bound by the random generator.
"""
from __future__ import annotations

import math

import torch


_BLOCK = 1 << 22  # elements generated at random; the rest of a tensor repeats them
E4M3_MAX = 448.0


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        bound = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02
        quant = getattr(p, "quant", None)
        if quant is not None and quant.fmt == "mxfp4":  # random e2m1 codes (|value| <= 6), scales 2^e, 6 * 2^e ~ bound
            exponent = max(-127, min(127, round(math.log2(2 * p.shape[-1]) * -0.5 - math.log2(6.0))))
            quant.scale.fill_(127 + exponent)
            codes = torch.randint(0, 256, (min(p.numel(), _BLOCK),), generator=gen, dtype=torch.uint8)
            fill_repeating(p, codes.to(p.device))
            continue
        if quant is not None and quant.fmt == "int4":  # random codes (any bits), scales of +-bound
            bound = p.shape[-1] ** -0.5 / 8 ** 0.5  # K = 8 x the packed width
            quant.scale.fill_(bound / 8)
            if quant.zero is not None:
                quant.zero.fill_(8)
            fill_repeating(p, torch.randint(-2 ** 31, 2 ** 31, (min(p.numel(), _BLOCK),), generator=gen,
                                            dtype=torch.int64).to(torch.int32).to(p.device))
            continue
        if quant is not None:  # values over e4m3's range, the scales bring them back to +-bound
            quant.scale_inv.fill_(bound / E4M3_MAX)
            bound = E4M3_MAX
        block = (torch.rand(min(p.numel(), _BLOCK), generator=gen) * 2 - 1).mul_(bound)
        fill_repeating(p, block.to(p.device).to(p.dtype))


def fill_repeating(t: torch.Tensor, block: torch.Tensor, start: int = 0) -> int:
    """t <- block repeated, element i of t being block[(start + i) % len(block)] whatever t's strides (a strided view,
    e.g. an offload tier's record or an NVMe file map, is filled row by row with the same values as a contiguous
    tensor: an offloaded model gets the resident one's weights). Returns where the next element's value starts."""
    n = block.numel()
    if not t.is_contiguous():
        for row in t:
            start = fill_repeating(row, block, start)
        return start
    flat = t.view(-1)
    i = 0
    while i < flat.numel():
        off = (start + i) % n
        take = min(n - off, flat.numel() - i)
        flat[i:i + take].copy_(block[off:off + take])
        i += take
    return (start + flat.numel()) % n
