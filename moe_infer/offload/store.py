"""The expert store interface, and the resident store. Registry `EXPERT_STORES` (config: offload.store).

An MoE layer asks its store, right before the experts run, for the experts of the step. The
resident store (`is_resident`) is the identity map: every local expert is its own slot, the layer
runs on `weights()` as they are, and nothing happens per step (no host sync: CUDA graphs capture
it). An offloading store (offloaded.py, "cpu" and "nvme") answers `fetch(x_TD, topk_ids_TK)` with
a `FetchedExperts`: device slot tensors, a local expert -> slot map, and the experts that run
elsewhere this step (stream buffers, CPU).

Legend: E local experts, F expert intermediate, D hidden.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from moe_infer.registry import Registry

EXPERT_STORES: Registry[type] = Registry("expert store")


@EXPERT_STORES.register("resident")
class ResidentExpertStore(nn.Module):
    is_resident = True

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 quant=None, bias: bool = False, **_) -> None:
        """quant: a QuantSpec (moe_infer/quant.py): the weights stored quantized, each with its scales.
        bias: the experts have a gate/up bias b13_E2F (gate; up) and a down bias b2_ED (GPT-OSS), in dtype."""
        super().__init__()
        E, D, F = num_local_experts, hidden_size, intermediate_size
        if bias:
            self.b13_E2F = nn.Parameter(torch.empty(E, 2 * F, dtype=dtype), requires_grad=False)
            self.b2_ED = nn.Parameter(torch.empty(E, D, dtype=dtype), requires_grad=False)
        else:
            self.b13_E2F = self.b2_ED = None
        if quant is not None:
            from moe_infer.quant import quantized_param

            quantized_param(self, "w13_E2FD", (E, 2 * F, D), quant, dtype)
            quantized_param(self, "w2_EDF", (E, D, F), quant, dtype)
            return
        self.w13_E2FD = nn.Parameter(torch.empty(E, 2 * F, D, dtype=dtype), requires_grad=False)
        self.w2_EDF = nn.Parameter(torch.empty(E, D, F, dtype=dtype), requires_grad=False)

    def weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.w13_E2FD, self.w2_EDF

    def biases(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(b13_E2F, b2_ED), or (None, None) for experts without biases."""
        return self.b13_E2F, self.b2_ED
