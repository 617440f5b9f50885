"""Launch wrappers for the permutation / ranking kernels (`moe_infer.kernels.permute_rows`).

Registers PERMUTE_BACKENDS["triton"]; `expert_ranks_triton` is the ranking step of the Triton
capacity backend. Legend: T tokens, K top-k, N = T*K rows, E (local) experts, S tiles, P padded
slots, B blocks. Same results, bit for bit, as the PyTorch references (`permute_rows_torch`,
`expert_ranks_torch`); three launches, no host sync.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from moe_infer.kernels.pdl import use_pdl
from moe_infer.kernels.permute_rows import tile_hist_kernel, tile_scan_kernel, tile_scatter_kernel
from moe_infer.routing.permute import (
    PERMUTE_BACKENDS, BlockLayout, RowPermutation, max_padded_rows, permute_rows_torch,
)
from moe_infer.routing.triton_common import check_int_ids, check_triton_device

MAX_EXPERTS = 1024
PDL_ENV = "MOE_ROUTING_PDL"  # "0": the routing kernels launch without programmatic dependent launch


FILL = 1024  # padded slots pre-filled with the sentinel per program of launch 1


def _blocks(block_e: int) -> Tuple[int, int]:
    """(BLOCK_N rows per tile, BLOCK_B blocks per program): the [BLOCK_N, BLOCK_E] histogram and
    [BLOCK_B, BLOCK_E] block-owner compares stay <= 16K elements, in registers (ptxas -v, sm_90)."""
    return (128 if block_e <= 32 else 64), max(16, min(128, 4096 // block_e))


def _check(ids_TK: torch.Tensor, num_experts: int, order_N: Optional[torch.Tensor]) -> None:
    check_int_ids("topk_ids_TK", ids_TK)
    check_triton_device("topk_ids_TK", ids_TK)
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if order_N is not None and (order_N.shape != (ids_TK.numel(),) or order_N.device != ids_TK.device):
        raise ValueError(f"order_N must be [N={ids_TK.numel()}] on {ids_TK.device}, got {tuple(order_N.shape)}")


def _warps(block_e: int) -> int:
    return 8 if block_e >= 128 else 4  # [BLOCK_N, BLOCK_E] compare tiles: keep them out of local memory


def scan_tiles(tile_counts_SE: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Launch 2, in place: tile_counts_SE [S, BLOCK_E] (int32) -> rows of each expert in earlier tiles.
    Returns counts_E (int64)."""
    num_tiles, block_e = tile_counts_SE.shape
    counts_E = torch.empty(num_experts, dtype=torch.int64, device=tile_counts_SE.device)
    chunk_e = min(block_e, 8)  # a [BLOCK_S, CHUNK_E] scan of <= 4096 counts: no spills on sm_90 (ptxas -v)
    block_s = min(triton.next_power_of_2(num_tiles), 4096 // chunk_e)
    tile_scan_kernel[(block_e // chunk_e,)](
        tile_counts_SE, counts_E, num_tiles, num_experts, BLOCK_E=block_e, BLOCK_S=block_s, CHUNK_E=chunk_e,
        **use_pdl(tile_counts_SE, PDL_ENV),
    )
    return counts_E


def _tile_counts(
    ids_N: torch.Tensor, order_N: Optional[torch.Tensor], num_experts: int, expert_start: int,
    sorted_rows_P: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """Launches 1 and 2: per-tile base ranks [S, BLOCK_E] (int32) and counts_E (int64); launch 1 also
    fills sorted_rows_P (if given) with the sentinel N."""
    N, device = ids_N.numel(), ids_N.device
    block_e = triton.next_power_of_2(num_experts)
    block_n = _blocks(block_e)[0]
    num_tiles = triton.cdiv(N, block_n)
    tile_counts_SE = torch.empty(num_tiles, block_e, dtype=torch.int32, device=device)
    order = order_N if order_N is not None else ids_N
    P = 0 if sorted_rows_P is None else sorted_rows_P.numel()
    tile_hist_kernel[(max(num_tiles, triton.cdiv(P, FILL)),)](
        ids_N, order, tile_counts_SE, sorted_rows_P if P else tile_counts_SE, N, num_experts, expert_start,
        num_tiles, P, HAS_ORDER=order_N is not None, BLOCK_N=block_n, BLOCK_E=block_e, FILL=FILL,
        num_warps=_warps(block_e), **use_pdl(ids_N, PDL_ENV),
    )
    return tile_counts_SE, scan_tiles(tile_counts_SE, num_experts), num_tiles, block_e


def expert_ranks_triton(
    ids_TK: torch.Tensor, num_experts: int, order_N: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """rank_N (int64, -1 for ids outside [0, E)) and counts_E (int64); see `expert_ranks_torch`."""
    _check(ids_TK, num_experts, order_N)
    ids_N = ids_TK.reshape(-1)
    N = ids_N.numel()
    rank_N = torch.empty(N, dtype=torch.int64, device=ids_N.device)
    if N == 0:
        return rank_N, torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device)
    tiles_SE, counts_E, num_tiles, block_e = _tile_counts(ids_N, order_N, num_experts, 0)
    block_n, block_b = _blocks(block_e)
    d = rank_N  # unused pointer arguments
    tile_scatter_kernel[(num_tiles,)](
        ids_N, order_N if order_N is not None else ids_N, d, tiles_SE, counts_E, d, d,
        rank_N, d, d, d, d, d, d, d, d, d,
        N, num_experts, 0, 1, num_tiles, 0, 0,
        HAS_ORDER=order_N is not None, WRITE_RANK=True, WRITE_PERMUTE=False, BLOCK_SIZE=0,
        BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_B=block_b, HAS_WITHIN=False, TILE_N=block_n, GROUP_TILES=1,
        num_warps=_warps(block_e), **use_pdl(ids_N, PDL_ENV),
    )
    return rank_N, counts_E


@PERMUTE_BACKENDS.register("triton")
def permute_rows_triton(
    topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int, expert_start: int = 0,
    block_size: Optional[int] = None,
) -> RowPermutation:
    """Same contract and results as `permute_rows_torch`."""
    _check(topk_ids_TK, num_experts, None)
    if topk_weights_TK.shape != topk_ids_TK.shape or topk_weights_TK.device != topk_ids_TK.device:
        raise ValueError("topk_weights_TK must match topk_ids_TK in shape and device")
    N, K, E, device = topk_ids_TK.numel(), topk_ids_TK.shape[1], num_experts, topk_ids_TK.device
    if N == 0:
        return permute_rows_torch(topk_ids_TK, topk_weights_TK, E, expert_start, block_size)
    ids_N = topk_ids_TK.reshape(-1).contiguous()
    w_N = topk_weights_TK.reshape(-1).contiguous()
    layout = new_block_layout(N, E, block_size, device)
    tiles_SE, counts_E, num_tiles, block_e = _tile_counts(
        ids_N, None, E, expert_start, layout.sorted_rows_P if layout else None
    )
    return scatter_rows(ids_N, w_N, K, tiles_SE, counts_E, E, expert_start, _blocks(block_e)[0], layout)


def new_block_layout(N: int, num_experts: int, block_size: Optional[int], device: torch.device) -> Optional[BlockLayout]:
    """Uninitialised BlockLayout buffers for N routed rows (None without a block size)."""
    if block_size is None:
        return None
    P = max_padded_rows(N, num_experts, block_size)
    return BlockLayout(
        block_size=block_size, sorted_rows_P=torch.empty(P, dtype=torch.int32, device=device),
        block_expert_B=torch.empty(P // block_size, dtype=torch.int32, device=device),
        padded_offsets_E1=torch.empty(num_experts + 1, dtype=torch.int64, device=device),
        num_padded=torch.empty(1, dtype=torch.int32, device=device),
    )


def scatter_rows(
    ids_N: torch.Tensor, w_N: torch.Tensor, K: int, tiles_SE: torch.Tensor, counts_E: torch.Tensor,
    num_experts: int, expert_start: int, block_n: int, layout: Optional[BlockLayout],
    within_TE: Optional[torch.Tensor] = None, rows_per_program: Optional[int] = None,
    hist_SE: Optional[torch.Tensor] = None, group_tiles: int = 1, zero_groups: bool = False,
) -> RowPermutation:
    """Launch 3: rows of tile s = [s*block_n, (s+1)*block_n) to their sorted / padded places, given the
    scanned tile counts (launch 2). layout.sorted_rows_P must already hold the sentinel N. within_TE (int8
    [T, BLOCK_E], from the fused gate) holds each row's rank inside its tile (at its token and expert); every row is then local (expert_start 0), and
    a program may place several tiles: rows_per_program, a multiple of block_n (default block_n). With
    group_tiles > 1, tiles_SE has a row per group of tiles and hist_SE (int8) a row per tile; zero_groups
    (then rows_per_program must be a multiple of block_n * group_tiles) sets those rows back to zero once read."""
    N, E, device = ids_N.numel(), num_experts, ids_N.device
    block_e = tiles_SE.shape[1]
    block_b = _blocks(block_e)[1]
    rows_per_program = rows_per_program or block_n
    if rows_per_program % block_n or (within_TE is None and rows_per_program != block_n):
        raise ValueError(f"rows_per_program={rows_per_program} must be block_n={block_n} (or a multiple, with within_TE)")
    if zero_groups and (group_tiles < 2 or rows_per_program % (block_n * group_tiles)):
        raise ValueError(f"zero_groups needs groups of tiles (group_tiles={group_tiles}) that each lie in one "
                         f"program of {rows_per_program} rows (tiles of {block_n})")
    num_programs = triton.cdiv(N, rows_per_program)
    i64 = dict(dtype=torch.int64, device=device)
    order_R, inv_N, token_R = torch.empty(N, **i64), torch.empty(N, **i64), torch.empty(N, **i64)
    weights_R = torch.empty(N, dtype=torch.float32, device=device)
    offsets_E1 = torch.empty(E + 1, **i64)
    num_blocks = layout.block_expert_B.numel() if layout else 0
    lay = (layout.sorted_rows_P, layout.block_expert_B, layout.padded_offsets_E1, layout.num_padded) if layout else (
        order_R,) * 4
    tile_scatter_kernel[(max(num_programs, triton.cdiv(num_blocks, block_b)),)](
        ids_N, ids_N, w_N, tiles_SE, counts_E, within_TE if within_TE is not None else ids_N,
        hist_SE if hist_SE is not None else ids_N,
        order_R, order_R, inv_N, token_R, weights_R, offsets_E1, *lay,
        N, E, expert_start, K, num_programs, num_blocks, tiles_SE.shape[0],
        HAS_ORDER=False, WRITE_RANK=False, WRITE_PERMUTE=True, BLOCK_SIZE=layout.block_size if layout else 0,
        BLOCK_N=rows_per_program, BLOCK_E=block_e, BLOCK_B=block_b, HAS_WITHIN=within_TE is not None,
        TILE_N=block_n, GROUP_TILES=group_tiles, ZERO_GROUPS=zero_groups,
        num_warps=4 if within_TE is not None else _warps(block_e), **use_pdl(ids_N, PDL_ENV),
    )
    return RowPermutation(
        order_R=order_R, inv_N=inv_N, token_idx_R=token_R, weights_R=weights_R,
        counts_E=counts_E, offsets_E1=offsets_E1, layout=layout,
    )
