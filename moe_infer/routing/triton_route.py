"""Fused GPU routing: router logits -> top-k -> routed rows sorted and block-padded by expert, in three
launches instead of four. The gate program of BLOCK_T tokens is also the permutation's first launch for
its BLOCK_T*K routed rows (one tile): it knows each token's chosen experts, so it writes the tile's expert
histogram (and the padding sentinel) itself; then the tile scan and the scatter of `triton_permute` run.

Legend: T tokens, E experts, K top-k, N = T*K routed rows, S tiles (gate programs), P padded slots.
Same results, bit for bit, as `select_experts_triton` + `permute_rows_triton` (and the PyTorch references).

No memset per call: the one-warp gate programs add their counts atomically into one row per group of
tiles, which must start at zero. That buffer is kept per device and stays all-zero between calls: the
scatter program that reads a group row last sets it back to zero (`tile_scatter_kernel`, ZERO_GROUPS).
So calls on one device must not run concurrently on two streams (the engine runs its layers on one);
inside a CUDA-graph capture that would need a larger buffer, the call zeroes a fresh one instead. The
three kernels launch with programmatic dependent launch on sm_90+ (MOE_ROUTING_PDL=0 turns it off).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import triton

from moe_infer.routing.permute import RowPermutation
from moe_infer.routing.spec import RoutingSpec
from moe_infer.routing.triton_permute import new_block_layout, permute_rows_triton, scan_tiles, scatter_rows
from moe_infer.routing.triton_select import check_gate_inputs, gate_launch_config, launch_gate, select_experts_triton

TILE_ROWS = 128  # routed rows per gate program (tile) when T allows: fewer tiles to scan
SCATTER_ROWS = 512  # routed rows per scatter program (several tiles): its fixed E-wide prefix sums amortised
GROUP_ROWS = 128  # routed rows per scanned group of one-warp gate tiles
WIDE_GATE = False  # see route_rows_triton; measured on H100: benchmarks/results/routing_launches_*.json
_ZEROED: Dict[tuple, List[torch.Tensor]] = {}  # per device: zeroed group-count buffers, the last one the largest


def kept_zero_buffers(device: torch.device) -> List[torch.Tensor]:
    """The device's kept-zero group-count buffers (the last one the largest)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _ZEROED.setdefault((device.type, device.index), [])


def zeroed_group_counts(num_elems: int, device: torch.device) -> Tuple[torch.Tensor, bool]:
    """(int32 [num_elems] of zeros, is_shared): the device's kept-zero buffer (the caller's last kernel must
    zero what it used), or, inside a graph capture that needs a larger one, a fresh zeroed tensor. Buffers
    are never freed: a captured graph may still write to an outgrown one."""
    bufs = kept_zero_buffers(device)
    if not bufs or bufs[-1].numel() < num_elems:
        fresh = torch.zeros(max(num_elems, 2 * bufs[-1].numel() if bufs else 0), dtype=torch.int32, device=device)
        if fresh.is_cuda and torch.cuda.is_current_stream_capturing():
            return fresh[:num_elems], False  # the memset is part of the graph; not kept (graph-pool memory)
        bufs.append(fresh)
    return bufs[-1][:num_elems], True


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
    rows_per_scatter: int = SCATTER_ROWS, group_rows: int = GROUP_ROWS, wide_gate: bool = WIDE_GATE,
    keep_zeroed: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, RowPermutation]:
    """(topk_weights_TK float32, topk_ids_TK int32, RowPermutation over all E experts): the results of
    `select_experts_triton` then `permute_rows_triton(ids, weights, E, 0, block_size)`, without a host sync.
    Tuning only (results do not change): rows_per_scatter (a power of 2), rows a scatter program places at
    most; wide_gate: gate programs of >= TILE_ROWS rows over several warps, each its own tile (cross-warp
    sums and scans in the gate); else one-warp gate programs (as `select_experts_triton`), each a tile, whose
    counts also add up atomically per group of ~group_rows rows: the scan sees one row per group; keep_zeroed:
    those group counts use the device's kept-zero buffer (re-zeroed by the scatter) instead of a memset per call."""
    bias_E = check_gate_inputs(logits_TE, spec, bias_E)
    T, E = logits_TE.shape
    K, device = spec.top_k, logits_TE.device
    if T == 0 or K & (K - 1):  # a tile of BLOCK_T*K rows must be a power of 2: the two-step path
        weights_TK, ids_TK = select_experts_triton(logits_TE, spec, bias_E)
        return weights_TK, ids_TK, permute_rows_triton(ids_TK, weights_TK, E, 0, block_size)
    block_e = triton.next_power_of_2(E)
    if wide_gate:
        (block_t, num_warps), group_tiles = fused_launch_config(T, E, K), 1
    else:
        block_t, _, num_warps = gate_launch_config(T, E)
        group_tiles = triton.next_power_of_2(max(1, group_rows // (block_t * K)))
    num_tiles = triton.cdiv(T, block_t)
    tile_n = block_t * K
    scatter_n = max(tile_n, min(rows_per_scatter, triton.next_power_of_2(T * K)))
    hist_SE, zero_groups = None, False
    if group_tiles > 1:  # counts per group of tiles accumulate atomically: a zeroed buffer
        num_groups = triton.cdiv(num_tiles, group_tiles)
        if keep_zeroed and scatter_n % (tile_n * group_tiles) == 0:  # each group read by one scatter program
            flat, zero_groups = zeroed_group_counts(num_groups * block_e, device)
            tile_counts_SE = flat.view(num_groups, block_e)
        else:
            tile_counts_SE = torch.zeros(num_groups, block_e, dtype=torch.int32, device=device)
        hist_SE = torch.empty(num_tiles, block_e, dtype=torch.int8, device=device)
    else:
        tile_counts_SE = torch.empty(num_tiles, block_e, dtype=torch.int32, device=device)
    layout = new_block_layout(T * K, E, block_size, device)
    weights_TK = torch.empty(T, K, dtype=torch.float32, device=device)
    ids_TK = torch.empty(T, K, dtype=torch.int32, device=device)
    within_TE = torch.empty(T, block_e, dtype=torch.int8, device=device)
    launch_gate(logits_TE, spec, bias_E, weights_TK, ids_TK, block_t, num_warps, tile_counts_SE, within_TE,
                layout.sorted_rows_P if layout else None, hist_SE, group_tiles)
    counts_E = scan_tiles(tile_counts_SE, E)
    perm = scatter_rows(ids_TK.view(-1), weights_TK.view(-1), K, tile_counts_SE, counts_E, E, 0, tile_n, layout,
                        within_TE, scatter_n, hist_SE, group_tiles, zero_groups)
    return weights_TK, ids_TK, perm
