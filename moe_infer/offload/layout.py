"""What one expert is made of, in its checkpoint's format: the tensors every offload tier holds, moves and slots.

An unquantized expert is two tensors, w13 [2F, D] and w2 [D, F] in the model dtype. A quantized one is, for
each of the two weights, the tensors its format stores (`QuantSpec.weight_tensors`: fp8 block-scaled = the
fp8 data and its float32 `_scale_inv` blocks; group-wise int4: int32 packed codes, `_scale` (the model dtype)
and, asymmetric, uint8 `_zero`; mxfp4: uint8 packed e2m1 codes and uint8 e8m0 `_scales`). The tiers never look
inside: the host tier and the NVMe records hold each expert as those tensors back to back (`views`), the GPU
slot pool and stream buffers hold them per slot (`pool`), a copy moves every one of them, and only the kernels
(which dispatch on the format `weights` attaches to the data) or the CPU path (`dequantize`, one expert at a
time) read the values. Budgets are counted in `nbytes`, the bytes
the format really takes. Experts with biases (GPT-OSS) carry them as two more tensors of the record, `b13` [2F]
and `b2` [D] in the model dtype, first in the record; `weights` hands them to the compute as the data's
`expert_bias` attribute.

Legend: X experts or slots of a pool, D hidden, F expert intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from moe_infer.quant import QuantSpec, dequantized

_ALIGN = 64  # each tensor of a record starts at a multiple of this (any dtype's view, vector loads)
WEIGHTS = ("w13", "w2")
BIASES = ("b13", "b2")


@dataclass(frozen=True)
class ExpertTensor:
    name: str  # "w13" / "w2", plus the format's suffix ("w13_scale_inv")
    shape: Tuple[int, ...]  # one expert's
    dtype: torch.dtype
    offset: int  # in the expert's record

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class ExpertLayout:
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 quant: Optional[QuantSpec] = None, bias: bool = False) -> None:
        D, F = hidden_size, intermediate_size
        self.dtype, self.quant, self.has_bias = dtype, quant, bias
        parts = [(b, (n,), dtype) for b, n in zip(BIASES, (2 * F, D))] if bias else []
        for base, (n, k) in zip(WEIGHTS, ((2 * F, D), (D, F))):
            fmt = (("", (n, k), dtype),) if quant is None else quant.weight_tensors(n, k, dtype)
            parts += [(base + suffix, shape, dt) for suffix, shape, dt in fmt]
        tensors, offset = [], 0
        for name, shape, dt in parts:
            t = ExpertTensor(name, tuple(shape), dt, offset)
            tensors.append(t)
            offset += -(-t.nbytes // _ALIGN) * _ALIGN
        self.tensors: Tuple[ExpertTensor, ...] = tuple(tensors)
        self.stride = offset  # bytes of one expert's record in the host tier
        self.nbytes = sum(t.nbytes for t in tensors)  # what one expert moves over the link, and costs in a slot

    @property
    def is_quantized(self) -> bool:
        return self.quant is not None

    def nbytes_of(self, base: str) -> int:
        """Bytes of one weight ("w13" or "w2") with its scales."""
        return sum(t.nbytes for t in self.tensors if t.name == base or t.name.startswith(base + "_"))

    def views(self, rec_XB: torch.Tensor) -> Dict[str, torch.Tensor]:
        """name -> [X, *shape] views into uint8 records [X, >= stride] (a host region, a file map, host slots)."""
        X = rec_XB.shape[0]
        return {t.name: rec_XB[:, t.offset:t.offset + t.nbytes].view(t.dtype).view(X, *t.shape) for t in self.tensors}

    def pool(self, num: int, device: torch.device) -> Dict[str, torch.Tensor]:
        """name -> [num, *shape] device tensors (cache slots, a stream buffer), each allocated on its own."""
        return {t.name: torch.empty(num, *t.shape, dtype=t.dtype, device=device) for t in self.tensors}

    def weights(self, tensors: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) of a pool, a tier or one expert, each carrying its format (the kernels dispatch on it) and,
        with biases, its bias as `expert_bias` (b13 on w13, b2 on w2)."""
        out = []
        for base, bias in zip(WEIGHTS, BIASES):
            data = tensors[base]
            if self.quant is not None:
                data = self.quant.attach(data, {t.name[len(base):]: tensors[t.name] for t in self.tensors
                                                if t.name.startswith(base + "_")})
            if self.has_bias:
                data.expert_bias = tensors[bias]
            out.append(data)
        return out[0], out[1]

    def dequantize(self, expert: Dict[str, torch.Tensor], dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """One expert's (w13 [2F, D], w2 [D, F]) in dtype (the tensors as they are when unquantized), with its
        biases as `expert_bias` where it has them."""
        if self.quant is None:
            w13, w2 = self.weights(expert)
            return w13, w2
        w13, w2 = self.weights(expert)
        out13, out2 = dequantized(w13, dtype), dequantized(w2, dtype)
        if self.has_bias:
            out13.expert_bias, out2.expert_bias = w13.expert_bias, w2.expert_bias
        return out13, out2

    def describe(self) -> str:
        return ", ".join(f"{t.name} {list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in self.tensors)
