"""The expert-load counters of one MoE layer in one launch (`moe_infer.routing.stats.ExpertLoadStats.record`).

The torch path takes 4 launches for a dropless layer (two casts, two scatter-adds) and 8 with a capacity
policy: on an H100 about 5.7 us of a decode step's ~91 us per layer at batch 1. Here one program per
BLOCK routed rows counts its rows per expert (a histogram in the program) and adds the nonzero counts to
the counters with one atomic each; a step of at most E rows (decode) adds an atomic per row instead:

    routed[ids[n]]    += c_n          processed[kept[n]] += c_n  (kept[n] >= 0)
    dropped[ids[n]]   += c_n  (kept[n] < 0)
    rerouted[ids[n]]  += c_n  (kept[n] >= 0 and kept[n] != ids[n])

with c_n = valid[n // K] (1 without a padding mask). Without kept (the dropless policy) processed counts the
routed ids and nothing is dropped or rerouted. A row that does not count (masked, padding, or an id outside
[0, E)) goes to an extra bin E that is never added. An atomic per row instead (the first version) made each
program's 2 x BLOCK atomics queue on the E counters: 13.7 us a layer for 1,024 tokens x top-8 on an H100.
Integer atomics: the counts are exact, in any order. No host sync (CUDA-graph safe). The reference is the
torch path of `ExpertLoadStats.record`.

Several layers in one launch: with ids [n, T, K] and counter rows [n, E] (views into the [L, E] counters,
any row stride), grid axis 1 runs entry i's rows into row i. The engine defers a forward's layers to its end
(`ExpertLoadStats.defer` / `flush`): at batch 1 on an H100 each layer's own launch sat on the critical path
between the router and the experts, ~3.5 us of a ~86 us layer.

Legend: T tokens, K top-k, N = T*K routed rows, E experts.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import triton
import triton.language as tl

BLOCK = 1024


# one variant for every step size and with or without a padding mask (warm-up runs masked forwards only, so an
# unmasked eager step must not select a variant of its own: see moe_infer/engine/warmup.py)
@triton.jit(do_not_specialize=["N", "has_valid", "stride_c"])
def expert_load_kernel(ids_ptr, kept_ptr, valid_ptr, routed_ptr, processed_ptr, dropped_ptr, rerouted_ptr, N,
                       has_valid, stride_c, K: tl.constexpr, E: tl.constexpr, BINS: tl.constexpr,
                       HAS_KEPT: tl.constexpr, BLOCK_N: tl.constexpr):
    entry = tl.program_id(1)  # a layer of a several-layer launch: its N rows, its counter row
    ids_ptr += entry * N
    kept_ptr += entry * N
    routed_ptr += entry * stride_c
    processed_ptr += entry * stride_c
    dropped_ptr += entry * stride_c
    rerouted_ptr += entry * stride_c
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = offs < N
    ids = tl.load(ids_ptr + offs, mask=is_row, other=0).to(tl.int32)
    live = is_row & (ids >= 0) & (ids < E)
    if has_valid != 0:
        live = live & (tl.load(valid_ptr + offs // K, mask=is_row, other=0) != 0)
    if N <= E:  # few rows (decode): an atomic per row, few enough not to queue (the histogram costs more here)
        one = tl.full([BLOCK_N], 1, tl.int64)
        ids = tl.where(live, ids, 0)
        tl.atomic_add(routed_ptr + ids, one, mask=live)
        if HAS_KEPT:
            kept = tl.load(kept_ptr + offs, mask=is_row, other=-1).to(tl.int32)
            is_kept = (kept >= 0) & (kept < E)
            tl.atomic_add(processed_ptr + tl.where(is_kept, kept, 0), one, mask=live & is_kept)
            tl.atomic_add(dropped_ptr + ids, one, mask=live & (kept < 0))
            tl.atomic_add(rerouted_ptr + ids, one, mask=live & is_kept & (kept != ids))
        else:
            tl.atomic_add(processed_ptr + ids, one, mask=live)
    else:
        bins = tl.arange(0, BINS)
        to_add = bins < E
        routed = tl.histogram(tl.where(live, ids, E), BINS).to(tl.int64)  # bin E: the rows that do not count
        tl.atomic_add(routed_ptr + bins, routed, mask=to_add & (routed != 0))
        if HAS_KEPT:
            kept = tl.load(kept_ptr + offs, mask=is_row, other=-1).to(tl.int32)
            is_kept = (kept >= 0) & (kept < E)
            processed = tl.histogram(tl.where(live & is_kept, kept, E), BINS).to(tl.int64)
            dropped = tl.histogram(tl.where(live & (kept < 0), ids, E), BINS).to(tl.int64)
            rerouted = tl.histogram(tl.where(live & is_kept & (kept != ids), ids, E), BINS).to(tl.int64)
            tl.atomic_add(processed_ptr + bins, processed, mask=to_add & (processed != 0))
            tl.atomic_add(dropped_ptr + bins, dropped, mask=to_add & (dropped != 0))
            tl.atomic_add(rerouted_ptr + bins, rerouted, mask=to_add & (rerouted != 0))
        else:
            tl.atomic_add(processed_ptr + bins, routed, mask=to_add & (routed != 0))


def record_load_triton(routed_E: torch.Tensor, processed_E: torch.Tensor, dropped_E: torch.Tensor,
                       rerouted_E: torch.Tensor, topk_ids_TK: torch.Tensor, kept_ids_TK: Optional[torch.Tensor],
                       valid_T: Optional[torch.Tensor]) -> None:
    """Adds one layer's counts to the int64 counters [E] (in place); see the module docstring. Several layers:
    ids (and kept ids) [n, T, K], counters [n, E] (one row per entry, unit column stride, any row stride)."""
    layers = topk_ids_TK.dim() == 3
    n = topk_ids_TK.shape[0] if layers else 1
    T, K = topk_ids_TK.shape[-2:]
    want_dim = 2 if layers else 1
    for name, t in (("routed", routed_E), ("processed", processed_E), ("dropped", dropped_E), ("rerouted", rerouted_E)):
        if (t.dtype != torch.int64 or t.dim() != want_dim or t.stride(-1) != 1 or t.device != topk_ids_TK.device
                or t.stride(0) != routed_E.stride(0) or (layers and t.shape[0] != n)):
            shape = f"[{n}, E] rows of equal stride" if layers else "[E]"
            raise ValueError(f"{name} counters must be int64 {shape} with a unit last stride on {topk_ids_TK.device}, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    if kept_ids_TK is not None and kept_ids_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"kept ids {tuple(kept_ids_TK.shape)} must match the routed ids {tuple(topk_ids_TK.shape)}")
    if valid_T is not None and valid_T.shape != (T,):
        raise ValueError(f"the padding mask must be [{T}], got {tuple(valid_T.shape)}")
    N = T * K
    if N == 0 or n == 0:
        return
    ids_N = topk_ids_TK.reshape(-1).contiguous()
    kept_N = kept_ids_TK.reshape(-1).contiguous() if kept_ids_TK is not None else ids_N
    valid = valid_T.contiguous() if valid_T is not None else _no_mask(ids_N.device)
    E = routed_E.shape[-1]
    expert_load_kernel[(triton.cdiv(N, BLOCK), n)](
        ids_N, kept_N, valid, routed_E, processed_E, dropped_E, rerouted_E, N, int(valid_T is not None),
        routed_E.stride(0) if layers else 0, K=K, E=E, BINS=triton.next_power_of_2(E + 1),
        HAS_KEPT=kept_ids_TK is not None, BLOCK_N=BLOCK, num_warps=4,
    )


_NO_MASK: Dict[torch.device, torch.Tensor] = {}


def _no_mask(device: torch.device) -> torch.Tensor:
    """A bool tensor that is never read: the mask argument of an unmasked step has the masked steps' type."""
    if device not in _NO_MASK:
        _NO_MASK[device] = torch.ones(16, dtype=torch.bool, device=device)
    return _NO_MASK[device]
