"""The registry of expert-parallel row operations that the all-to-all dispatchers use (no triton here).

    EP_ROW_OPS["torch"]   the PyTorch implementations (`ep_ops_torch`): the CPU / gloo path, and the
                          references of the Triton kernels
    EP_ROW_OPS["triton"]  the Triton kernels (`ep_ops`), registered when that module is imported;
                          it is a plugin (`moe_infer.plugins`), so the engine runs without triton on CPU
    row_ops(device)       "triton" on CUDA, "torch" elsewhere

Legend: N routed rows, X rows of the send / receive buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

import torch

from moe_infer.kernels.ep_ops_torch import (
    combine_rows_torch, pack_rows_torch, recv_rows_torch, slot_pack_torch, slot_rows_torch,
)
from moe_infer.registry import Registry


@dataclass(frozen=True)
class RowOps:
    slot_rows: Callable[..., Tuple[torch.Tensor, torch.Tensor]]
    pack_rows: Callable[..., torch.Tensor]
    recv_rows: Callable[..., Tuple[torch.Tensor, torch.Tensor]]
    combine_rows: Callable[..., torch.Tensor]
    slot_pack: Callable[..., torch.Tensor]


SLOT_PACK_MAX_ROWS = 8192  # routed rows up to which `slot_pack` (every program scans them all) is used

EP_ROW_OPS: Registry[RowOps] = Registry("EP row ops")
EP_ROW_OPS.register("torch")(RowOps(slot_rows_torch, pack_rows_torch, recv_rows_torch, combine_rows_torch, slot_pack_torch))


def row_ops(device: torch.device) -> RowOps:
    """The row ops for tensors on `device`: Triton on CUDA, the PyTorch implementations elsewhere."""
    if torch.device(device).type != "cuda":
        return EP_ROW_OPS.get("torch")
    if "triton" not in EP_ROW_OPS:
        from moe_infer.plugins import load_plugins

        load_plugins()
    if "triton" not in EP_ROW_OPS:
        raise RuntimeError("expert parallelism on CUDA needs the Triton EP row kernels: pip install 'triton>=3.6'")
    return EP_ROW_OPS.get("triton")
