"""Launch wrappers: CAPACITY_KERNELS["triton"] (ranking from `triton_permute`, drop and reroute from
`moe_infer.kernels.routing_capacity`). Same integers as the PyTorch references in `capacity_ops`.

Legend: T tokens, E experts, K top-k, N = T*K rows.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from moe_infer.kernels.routing_capacity import drop_rows_kernel, reroute_kernel
from moe_infer.routing.capacity_ops import CAPACITY_KERNELS, CapacityOps
from moe_infer.routing.triton_common import check_int_ids, check_triton_device
from moe_infer.routing.triton_permute import expert_ranks_triton


def drop_rows_triton(
    ids_TK: torch.Tensor, weights_TK: torch.Tensor, rank_N: torch.Tensor, capacity: int, renormalize: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    check_int_ids("topk_ids_TK", ids_TK)
    check_triton_device("topk_ids_TK", ids_TK)
    if weights_TK.shape != ids_TK.shape or rank_N.shape != (ids_TK.numel(),):
        raise ValueError(f"weights {tuple(weights_TK.shape)} / rank {tuple(rank_N.shape)} do not match ids {tuple(ids_TK.shape)}")
    T, K = ids_TK.shape
    out_ids_TK = torch.empty(T, K, dtype=torch.int32, device=ids_TK.device)
    out_w_TK = torch.empty(T, K, dtype=torch.float32, device=ids_TK.device)
    if T == 0:
        return out_ids_TK, out_w_TK
    block_k = triton.next_power_of_2(K)
    block_t = max(1, min(128, 2048 // block_k, triton.next_power_of_2(T)))
    drop_rows_kernel[(triton.cdiv(T, block_t),)](
        ids_TK.contiguous(), weights_TK.contiguous(), rank_N, out_ids_TK, out_w_TK, T, capacity,
        K=K, RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_K=block_k,
    )
    return out_ids_TK, out_w_TK


def reroute_rows_triton(
    kept_ids_TK: torch.Tensor, topk_ids_TK: torch.Tensor, choice_TE: torch.Tensor, counts_E: torch.Tensor,
    order_N: Optional[torch.Tensor], capacity: int,
) -> torch.Tensor:
    """One program, sequential over the rows (see the kernel's docstring); no host sync."""
    check_int_ids("kept_ids_TK", kept_ids_TK)
    check_triton_device("kept_ids_TK", kept_ids_TK)
    T, K = kept_ids_TK.shape
    E = choice_TE.shape[1]
    if choice_TE.shape[0] != T or counts_E.shape != (E,) or topk_ids_TK.shape != (T, K):
        raise ValueError(f"choice {tuple(choice_TE.shape)} / counts {tuple(counts_E.shape)} do not match ids [T={T}, K={K}]")
    ids_TK = kept_ids_TK.to(torch.int32).contiguous().clone()
    if T == 0:
        return ids_TK
    order = order_N if order_N is not None else ids_TK
    reroute_kernel[(1,)](
        ids_TK, topk_ids_TK.contiguous(), choice_TE.float().contiguous(), counts_E, order, T * K, E, capacity,
        K=K, HAS_ORDER=order_N is not None, BLOCK_V=32, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_K=triton.next_power_of_2(K), num_warps=1,
    )
    return ids_TK


CAPACITY_KERNELS.register("triton")(CapacityOps(expert_ranks_triton, drop_rows_triton, reroute_rows_triton))
