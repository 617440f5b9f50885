"""What an expert computes around its two GEMMs: the gated activation and the optional biases.

  silu            act = silu(gate) * up                                   (Mixtral, Qwen, DeepSeek, OLMoE)
  clamped_swiglu  gate <- min(gate, limit), up <- clamp(up, -limit, limit),
                  act = (up + 1) * gate * sigmoid(alpha * gate)           (GPT-OSS: alpha 1.702, limit 7.0)

`ExpertExtras` travels with one expert call (the layer builds it from its store): the activation, the gate/up
bias [E, 2F] (gate; up halves, as w13) and the down bias [E, D]; biases are added before the activation and after
the down GEMM, and a row's output (bias included) is then scaled by its routing weight.

Legend: E local experts, F expert intermediate, D hidden, r rows of one expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertAct:
    kind: str = "silu"
    alpha: float = 1.702  # clamped_swiglu: the sigmoid's gain
    limit: float = 7.0  # clamped_swiglu: gate clamped above, up on both sides

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {ACTIVATIONS}, got {self.kind!r}")

    def __call__(self, gate_rF: torch.Tensor, up_rF: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate_rF) * up_rF
        gate_rF = gate_rF.clamp(max=self.limit)
        up_rF = up_rF.clamp(min=-self.limit, max=self.limit)
        return (up_rF + 1) * (gate_rF * torch.sigmoid(gate_rF * self.alpha))


SILU = ExpertAct()


@dataclass(frozen=True)
class ExpertExtras:
    """The activation and biases of one expert call (None: no bias)."""

    act: ExpertAct = SILU
    b13_E2F: Optional[torch.Tensor] = None
    b2_ED: Optional[torch.Tensor] = None
