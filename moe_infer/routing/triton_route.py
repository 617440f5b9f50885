"""Fused GPU routing: router logits -> top-k -> routed rows sorted and block-padded by expert, in three
launches instead of four. The gate program of BLOCK_T tokens is also the permutation's first launch for
its BLOCK_T*K routed rows (one tile): it knows each token's chosen experts, so it writes the tile's expert
histogram (and the padding sentinel) itself; then the tile scan and the scatter of `triton_permute` run.

Legend: T tokens, E experts, K top-k, N = T*K routed rows, S tiles (gate programs), P padded slots.
Same results, bit for bit, as `select_experts_triton` + `permute_rows_triton` (and the PyTorch references).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from moe_infer.routing.permute import RowPermutation
from moe_infer.routing.spec import RoutingSpec
from moe_infer.routing.triton_permute import new_block_layout, permute_rows_triton, scan_tiles, scatter_rows
from moe_infer.routing.triton_select import check_gate_inputs, gate_launch_config, launch_gate, select_experts_triton

TILE_ROWS = 128  # routed rows per gate program (tile) when T allows: fewer tiles to scan
SCATTER_ROWS = 512  # routed rows per scatter program (several tiles): its fixed E-wide prefix sums amortised


def fused_launch_config(num_tokens: int, num_experts: int, top_k: int) -> Tuple[int, int]:
    """(BLOCK_T, num_warps) of the fused gate: at least TILE_ROWS / K tokens a program, ~512 scores a warp
    (a warp's tokens are whole rows of its registers when the logits load is vectorised: no cross-warp
    reductions in the top-k)."""
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(gate_launch_config(num_tokens, num_experts)[0],
                  min(triton.next_power_of_2(num_tokens), max(1, TILE_ROWS // top_k)))
    return block_t, max(1, min(8, block_t * block_e // 512))


def route_rows_triton(
    logits_TE: torch.Tensor, spec: RoutingSpec, bias_E: Optional[torch.Tensor] = None, block_size: Optional[int] = None,
    rows_per_scatter: int = SCATTER_ROWS,
) -> Tuple[torch.Tensor, torch.Tensor, RowPermutation]:
    """(topk_weights_TK float32, topk_ids_TK int32, RowPermutation over all E experts): the results of
    `select_experts_triton` then `permute_rows_triton(ids, weights, E, 0, block_size)`, without a host sync.
    rows_per_scatter (a power of 2): rows a scatter program places at most (tuning only; results do not change)."""
    bias_E = check_gate_inputs(logits_TE, spec, bias_E)
    T, E = logits_TE.shape
    K, device = spec.top_k, logits_TE.device
    if T == 0 or K & (K - 1):  # a tile of BLOCK_T*K rows must be a power of 2: the two-step path
        weights_TK, ids_TK = select_experts_triton(logits_TE, spec, bias_E)
        return weights_TK, ids_TK, permute_rows_triton(ids_TK, weights_TK, E, 0, block_size)
    block_t, num_warps = fused_launch_config(T, E, K)
    tile_counts_SE = torch.empty(triton.cdiv(T, block_t), triton.next_power_of_2(E), dtype=torch.int32, device=device)
    layout = new_block_layout(T * K, E, block_size, device)
    weights_TK = torch.empty(T, K, dtype=torch.float32, device=device)
    ids_TK = torch.empty(T, K, dtype=torch.int32, device=device)
    within_N = torch.empty(T * K, dtype=torch.int32, device=device)
    launch_gate(logits_TE, spec, bias_E, weights_TK, ids_TK, block_t, num_warps, tile_counts_SE, within_N,
                layout.sorted_rows_P if layout else None)
    counts_E = scan_tiles(tile_counts_SE, E)
    tile_n = block_t * K
    perm = scatter_rows(ids_TK.view(-1), weights_TK.view(-1), K, tile_counts_SE, counts_E, E, 0, tile_n, layout,
                        within_N, max(tile_n, min(rows_per_scatter, triton.next_power_of_2(T * K))))
    return weights_TK, ids_TK, perm
