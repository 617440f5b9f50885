"""Per-layer expert load statistics, accumulated on the device without a host sync per step.

On CUDA a registered kernel (LOAD_COUNT_KERNELS["triton"], `moe_infer.kernels.expert_load`, a plugin) adds a
layer's counts in one launch; everywhere else the torch path of `record` runs (the kernel's reference).

Legend: L MoE layers, E experts (global), K top-k.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch

from moe_infer.registry import Registry

# (routed_E, processed_E, dropped_E, rerouted_E, topk_ids_TK, kept_ids_TK or None, valid_T or None) -> None
LOAD_COUNT_KERNELS: Registry[Callable[..., None]] = Registry("expert load count kernel")


class ExpertLoadStats:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.routed_LE = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.dropped_LE = torch.zeros_like(self.routed_LE)
        self.rerouted_LE = torch.zeros_like(self.routed_LE)
        self.processed_LE = torch.zeros_like(self.routed_LE)  # rows each expert runs, after the policy

    def record(self, layer: int, topk_ids_TK: torch.Tensor, kept_ids_TK: torch.Tensor | None = None,
               valid_T: torch.Tensor | None = None) -> None:
        """topk_ids_TK: the router's choice; kept_ids_TK: after the capacity policy (-1 = dropped);
        valid_T: bool, rows that are padding (False) are not counted (None: all rows count).
        Counted per expert: routed (the router's choice), dropped and rerouted (by the router's
        choice), processed (by the expert that runs the row: kept and rerouted-to rows)."""
        if kept_ids_TK is topk_ids_TK:
            kept_ids_TK = None
        if topk_ids_TK.is_cuda and "triton" in LOAD_COUNT_KERNELS:
            LOAD_COUNT_KERNELS.get("triton")(self.routed_LE[layer], self.processed_LE[layer], self.dropped_LE[layer],
                                             self.rerouted_LE[layer], topk_ids_TK, kept_ids_TK, valid_T)
            return
        self.record_torch(layer, topk_ids_TK, kept_ids_TK, valid_T)

    def record_torch(self, layer: int, topk_ids_TK: torch.Tensor, kept_ids_TK: torch.Tensor | None = None,
                     valid_T: torch.Tensor | None = None) -> None:
        """`record` by torch ops (any device; the reference of the kernel)."""
        ids_N = topk_ids_TK.reshape(-1).long()
        count_N = (torch.ones_like(ids_N) if valid_T is None
                   else valid_T[:, None].expand(topk_ids_TK.shape).reshape(-1).long())
        self.routed_LE[layer].scatter_add_(0, ids_N, count_N)
        if kept_ids_TK is None:
            self.processed_LE[layer].scatter_add_(0, ids_N, count_N)
        else:
            kept_N = kept_ids_TK.reshape(-1).long()
            self.processed_LE[layer].scatter_add_(0, kept_N.clamp_min(0), (kept_N >= 0).long() * count_N)
            dropped_N = (kept_N < 0).long() * count_N
            self.dropped_LE[layer].scatter_add_(0, ids_N, dropped_N)
            moved_N = ((kept_N >= 0) & (kept_N != ids_N)).long() * count_N
            self.rerouted_LE[layer].scatter_add_(0, ids_N, moved_N)

    def imbalance_L(self) -> torch.Tensor:
        """float32 [L] on the device (no sync): max / mean routed rows per expert, 0 for an idle layer."""
        routed_LE = self.routed_LE.float()
        mean_L = routed_LE.mean(dim=1)
        return torch.where(mean_L > 0, routed_LE.amax(dim=1) / mean_L.clamp_min(1e-30), torch.zeros_like(mean_L))

    def reset(self) -> None:
        for t in (self.routed_LE, self.dropped_LE, self.rerouted_LE, self.processed_LE):
            t.zero_()

    def summary(self) -> List[Dict[str, object]]:
        """One dict per layer (this is where the host sync happens, on demand)."""
        routed = self.routed_LE.cpu()
        dropped, rerouted, processed = self.dropped_LE.cpu(), self.rerouted_LE.cpu(), self.processed_LE.cpu()
        out = []
        for layer in range(self.num_layers):
            load = routed[layer].double()
            total = float(load.sum())
            mean = total / self.num_experts
            p = load / total if total else load
            entropy = float(-(p[p > 0] * p[p > 0].log()).sum()) if total else 0.0
            out.append({
                "layer": layer,
                "routed": routed[layer].tolist(),
                "dropped": dropped[layer].tolist(),
                "rerouted": rerouted[layer].tolist(),
                "processed": processed[layer].tolist(),
                "imbalance": float(load.max()) / mean if total else 0.0,
                "entropy": entropy,
            })
        return out
