"""Token permutation without a host sync: routed rows sorted by expert, the inverse map, and each
expert's rows padded to the expert kernel's block size. PyTorch reference backend + registry.

Legend: T tokens, K top-k, N = T*K routed rows (n = t*K + k), E local experts, R = N dispatched rows,
P padded rows (a fixed upper bound, N + E*(block_size-1) rounded up to block_size), B blocks.
A row is *local* when `0 <= id - expert_start < E`; dropped (-1) and other ranks' rows are not.
Local rows come first, grouped by expert, in routed-row order within an expert (a stable sort);
the other rows follow in routed-row order. Shapes never depend on the routing (CUDA-graph safe).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moe_infer.registry import Registry
from moe_infer.routing.backends import resolve_backend


@dataclass(frozen=True)
class BlockLayout:
    """Rows of each expert padded to `block_size` (like vLLM's moe_align_block_size)."""

    block_size: int
    sorted_rows_P: torch.Tensor  # int32 [P]: routed row n at padded slot p; N marks a padding slot
    block_expert_B: torch.Tensor  # int32 [B = P / block_size]: local expert of each block, -1 past the end
    padded_offsets_E1: torch.Tensor  # int64 [E+1]: expert e owns slots [offsets[e], offsets[e+1])
    num_padded: torch.Tensor  # int32 [1]: padded_offsets_E1[-1], the slots in use


@dataclass(frozen=True)
class RowPermutation:
    order_R: torch.Tensor  # int64 [R]: routed row n held by dispatched row r
    inv_N: torch.Tensor  # int64 [N]: dispatched row of routed row n (order_R[inv_N] = arange)
    token_idx_R: torch.Tensor  # int64 [R]: order_R // K
    weights_R: torch.Tensor  # float32 [R]: routing weight of each dispatched row, 0 if not local
    counts_E: torch.Tensor  # int64 [E]: local rows per expert
    offsets_E1: torch.Tensor  # int64 [E+1]: exclusive prefix sum of counts_E
    layout: Optional[BlockLayout]  # None unless a block size was asked for


PermuteFn = Callable[[torch.Tensor, torch.Tensor, int, int, Optional[int]], RowPermutation]
PERMUTE_BACKENDS: Registry[PermuteFn] = Registry("permute backend")


def max_padded_rows(num_rows: int, num_experts: int, block_size: int) -> int:
    """P: enough slots for any routing (each expert wastes at most block_size - 1)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    bound = num_rows + num_experts * (block_size - 1)
    return -(-bound // block_size) * block_size


def local_keys(topk_ids_TK: torch.Tensor, num_experts: int, expert_start: int) -> torch.Tensor:
    """int64 [N]: local expert of each routed row, num_experts for dropped / non-local rows."""
    ids_N = topk_ids_TK.reshape(-1).long()
    local_N = ids_N - expert_start
    is_local_N = (ids_N >= 0) & (local_N >= 0) & (local_N < num_experts)
    return torch.where(is_local_N, local_N, torch.full_like(local_N, num_experts))


def block_layout_torch(key_N: torch.Tensor, num_experts: int, block_size: int) -> BlockLayout:
    """Reference padded layout from the local keys (num_experts = not local)."""
    N, E, device = key_N.numel(), num_experts, key_N.device
    P = max_padded_rows(N, E, block_size)
    key_R, order_R = torch.sort(key_N, stable=True)
    counts_E = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, key_N, torch.ones_like(key_N))[:E]
    padded_E = (counts_E + block_size - 1) // block_size * block_size
    padded_offsets_E1 = torch.zeros(E + 1, dtype=torch.int64, device=device)
    torch.cumsum(padded_E, 0, out=padded_offsets_E1[1:])
    offsets_E1 = torch.zeros(E + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts_E, 0, out=offsets_E1[1:])
    is_local_R = key_R < E
    key_c_R = key_R.clamp_max(E - 1) if E > 0 else key_R
    rank_R = torch.arange(N, device=device) - offsets_E1[key_c_R]
    slot_R = torch.where(is_local_R, padded_offsets_E1[key_c_R] + rank_R, torch.full_like(rank_R, P))
    sorted_rows_P1 = torch.full((P + 1,), N, dtype=torch.int32, device=device)
    sorted_rows_P1.scatter_(0, slot_R, order_R.to(torch.int32))  # non-local rows land on the spare slot P
    block_start_B = torch.arange(0, P, block_size, device=device)
    block_expert_B = torch.searchsorted(padded_offsets_E1[1:], block_start_B, right=True)
    block_expert_B = torch.where(block_expert_B < E, block_expert_B, torch.full_like(block_expert_B, -1))
    return BlockLayout(
        block_size=block_size, sorted_rows_P=sorted_rows_P1[:P], block_expert_B=block_expert_B.to(torch.int32),
        padded_offsets_E1=padded_offsets_E1, num_padded=padded_offsets_E1[-1:].to(torch.int32),
    )


@PERMUTE_BACKENDS.register("torch")
def permute_rows_torch(
    topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int, expert_start: int = 0,
    block_size: Optional[int] = None,
) -> RowPermutation:
    """Reference: a stable sort of the routed rows by local expert (the LocalDispatcher's logic)."""
    E, K = num_experts, topk_ids_TK.shape[1]
    key_N = local_keys(topk_ids_TK, E, expert_start)
    key_R, order_R = torch.sort(key_N, stable=True)
    counts_E1 = torch.zeros(E + 1, dtype=torch.int64, device=key_N.device)
    counts_E1.scatter_add_(0, key_N, torch.ones_like(key_N))
    counts_E = counts_E1[:E]
    offsets_E1 = torch.zeros(E + 1, dtype=torch.int64, device=key_N.device)
    torch.cumsum(counts_E, 0, out=offsets_E1[1:])
    inv_N = torch.empty_like(order_R)
    inv_N[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    weights_R = torch.where(
        key_R < E, topk_weights_TK.reshape(-1)[order_R].float(), torch.zeros((), device=key_N.device)
    )
    layout = None if block_size is None else block_layout_torch(key_N, E, block_size)
    return RowPermutation(
        order_R=order_R, inv_N=inv_N, token_idx_R=order_R // K, weights_R=weights_R,
        counts_E=counts_E, offsets_E1=offsets_E1, layout=layout,
    )


def permute_rows(
    topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int, expert_start: int = 0,
    block_size: Optional[int] = None, backend: str = "auto",
) -> RowPermutation:
    """Sorts routed rows by local expert with the backend for this device ("auto": Triton on CUDA)."""
    if topk_ids_TK.shape != topk_weights_TK.shape:
        raise ValueError(f"ids {tuple(topk_ids_TK.shape)} and weights {tuple(topk_weights_TK.shape)} differ")
    name = resolve_backend(PERMUTE_BACKENDS, backend, topk_ids_TK.device)
    return PERMUTE_BACKENDS.get(name)(topk_ids_TK, topk_weights_TK, num_experts, expert_start, block_size)


def align_rows_to_blocks(
    topk_ids_TK: torch.Tensor, num_experts: int, block_size: int, expert_start: int = 0, backend: str = "auto"
) -> BlockLayout:
    """The padded layout for a fused expert kernel: block b holds rows
    sorted_rows_P[b*block_size:(b+1)*block_size] (token = row // K) of expert block_expert_B[b]."""
    weights_TK = torch.zeros(topk_ids_TK.shape, dtype=torch.float32, device=topk_ids_TK.device)
    perm = permute_rows(topk_ids_TK, weights_TK, num_experts, expert_start, block_size, backend)
    return perm.layout
