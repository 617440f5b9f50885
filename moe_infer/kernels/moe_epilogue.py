"""What the fused experts' GEMM epilogues apply around the two GEMMs besides SiLU * up: per-expert biases and
GPT-OSS's clamped SwiGLU. One `Epilogue` travels with a call of the bf16 (fused_moe.py) or the W4A16
(fused_moe_w4a16.py) fused MoE; its Triton side is the two @triton.jit helpers of moe_epilogue_kernels.py that
the kernels call after their K loops, its PyTorch side (`gate_up_ref` / `down_ref`) the references'.

    gate_up   h = x W13^T (+ b13[e]),  act = silu(g) * u                                  (CLAMPED False)
                                       act = (clamp(u, -limit, limit) + 1) * g' sigmoid(alpha g'),
                                             g' = min(g, limit)                             (CLAMPED True)
    down      y = weight * (act W2^T + b2[e])     (the bias is scaled by the routing weight with the row,
                                                   as transformers' GptOssExperts does)

Biases: b13 [E, 2F] (gate half, then up half, as w13's rows) and b2 [E, D], of the local experts, any float dtype,
unit last stride.

Legend: E local experts, F expert intermediate, D hidden, M rows of a tile, n columns of a tile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Epilogue:
    clamped: bool = False  # GPT-OSS's clamped SwiGLU, else silu(gate) * up
    alpha: float = 1.702
    limit: float = 7.0
    b13_E2F: Optional[torch.Tensor] = None
    b2_ED: Optional[torch.Tensor] = None

    def check(self, E: int, F2: int, D: int, device: torch.device) -> None:
        for name, b, shape in (("b13_E2F", self.b13_E2F, (E, F2)), ("b2_ED", self.b2_ED, (E, D))):
            if b is None:
                continue
            if tuple(b.shape) != shape or b.stride(-1) != 1 or b.device != device or not b.is_floating_point():
                raise ValueError(f"expert bias {name} must be a float [{shape[0]}, {shape[1]}] tensor on {device} "
                                 f"with a unit last stride, got {b.dtype} {tuple(b.shape)} on {b.device}")

    def gate_up_args(self, dummy: torch.Tensor) -> dict:
        """The gate_up kernels' epilogue arguments (dummy: any tensor, the pointer when there is no bias)."""
        b = self.b13_E2F
        return dict(b13_ptr=dummy if b is None else b, stride_be=0 if b is None else b.stride(0),
                    HAS_BIAS=b is not None, CLAMPED=self.clamped, ALPHA=float(self.alpha), LIMIT=float(self.limit))

    def down_args(self, dummy: torch.Tensor) -> dict:
        b = self.b2_ED
        return dict(b2_ptr=dummy if b is None else b, stride_b2e=0 if b is None else b.stride(0),
                    HAS_BIAS2=b is not None)

    # ---- PyTorch references (float32 in, float32 out) ----------------------------------------------------------
    def gate_up_ref(self, h_r2F: torch.Tensor, e: int) -> torch.Tensor:
        """act [r, F] of expert e's gate/up rows h [r, 2F]."""
        if self.b13_E2F is not None:
            h_r2F = h_r2F + self.b13_E2F[e].float()
        f = h_r2F.shape[-1] // 2
        g, u = h_r2F[..., :f], h_r2F[..., f:]
        if not self.clamped:
            return F.silu(g) * u
        g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return (u + 1) * g * torch.sigmoid(g * self.alpha)

    def down_ref(self, y_rD: torch.Tensor, e: int) -> torch.Tensor:
        return y_rD if self.b2_ED is None else y_rD + self.b2_ED[e].float()


SWIGLU = Epilogue()


def is_plain(epilogue: Optional[Epilogue]) -> bool:
    """Whether `epilogue` is plain SwiGLU without biases (what every fused path runs without one)."""
    return epilogue is None or (not epilogue.clamped and epilogue.b13_E2F is None and epilogue.b2_ED is None)

