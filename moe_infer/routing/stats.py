"""Per-layer expert load statistics, accumulated on the device without a host sync per step.

On CUDA a registered kernel (LOAD_COUNT_KERNELS["triton"], `moe_infer.kernels.expert_load`, a plugin) adds a
layer's counts in one launch; everywhere else the torch path of `record` runs (the kernel's reference).

Nothing in a forward reads the counters, so a forward's MoE layers `defer` their counts and the forward's end
`flush`es them: on CUDA the layers of one step (same rows, same padding mask, evenly spaced layer ids) go
into one stack and one launch, off the path between each layer's router and its experts.

Legend: L MoE layers, E experts (global), K top-k.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

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
        self._pending: List[Tuple[int, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]] = []

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

    def defer(self, layer: int, topk_ids_TK: torch.Tensor, kept_ids_TK: torch.Tensor | None = None,
              valid_T: torch.Tensor | None = None) -> None:
        """`record`, held until `flush` (the end of the forward: moe_infer/layers/moe.py)."""
        self._pending.append((layer, topk_ids_TK, None if kept_ids_TK is topk_ids_TK else kept_ids_TK, valid_T))

    def flush(self) -> None:
        """Records what `defer` held: runs of layers with the same rows and padding mask and evenly spaced layer
        ids in one launch each on CUDA (one stack of their ids first), the rest layer by layer."""
        pending, self._pending = self._pending, []
        at = 0
        while at < len(pending):
            end = at + 1
            while end < len(pending) and _same_run(pending[at], pending[end - 1], pending[end], end - at):
                end += 1
            run = pending[at:end]
            layer, ids_TK, kept_TK, valid_T = run[0]
            if len(run) > 1 and ids_TK.is_cuda and "triton" in LOAD_COUNT_KERNELS:
                step = run[1][0] - layer
                rows = slice(layer, layer + step * (len(run) - 1) + 1, step)
                kept_nTK = None if kept_TK is None else torch.stack([r[2] for r in run])
                LOAD_COUNT_KERNELS.get("triton")(self.routed_LE[rows], self.processed_LE[rows], self.dropped_LE[rows],
                                                 self.rerouted_LE[rows], torch.stack([r[1] for r in run]), kept_nTK,
                                                 valid_T)
            else:
                for entry in run:
                    self.record(*entry)
            at = end

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


def _same_run(first: tuple, last: tuple, nxt: tuple, length: int) -> bool:
    """nxt continues a run of deferred layers that starts at first and ends at last (length entries): the same
    ids shape and device, kept ids or not alike, the same padding mask, the next evenly spaced layer id."""
    step = (last[0] - first[0]) // (length - 1) if length > 1 else nxt[0] - last[0]
    return (step > 0 and nxt[0] - last[0] == step and nxt[1].shape == first[1].shape
            and nxt[1].device == first[1].device and nxt[1].dtype == first[1].dtype
            and (nxt[2] is None) == (first[2] is None) and nxt[3] is first[3])
