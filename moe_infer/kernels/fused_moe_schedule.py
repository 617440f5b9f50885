"""The block-padded row schedule of the fused MoE GEMMs, and the backends that build it.

    BlockSchedule: rows of each local expert in routed order, padded to a multiple of block_m
      sorted_P[p]  routed row n at padded slot p, N (the sentinel) for a pad slot
      expert_B[b]  local expert of tile b, -1 past num_padded
      num_padded_1 live slots (one int32 on the device: nothing waits on the host)

Backends (SCHEDULE_BACKENDS, picked by `FusedMoEConfig.schedule`; "auto" picks by row count):
  inline   no launch: sorted_P holds ids_N and every GEMM program derives its own tile in
           registers (decode, N <= MAX_INLINE_ROWS)
  align    this package's kernels (fused_moe_align.py): 1 launch for one chunk, else 2
  permute  the routing package's permutation (moe_infer.routing.permute, Triton backend): 3
           launches spread over many programs; measured faster at large N on the H100
All three give the same slots for the same ids (tests), so the GEMMs do not care which ran.

Legend: N routed rows, E local experts, P padded slots, B tiles of block_m slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton

from moe_infer.kernels.fused_moe_align import align_count_kernel, align_scatter_kernel
from moe_infer.kernels.pdl import use_pdl
from moe_infer.registry import Registry

MAX_INLINE_ROWS = 64  # up to this many routed rows, the GEMMs can build the schedule in registers
MAX_INLINE_WORK = 2560  # "auto" inlines while N_PAD * (N_PAD + E_PAD) stays under this (H100: qwen3/olmoe T=1)
PERMUTE_MIN_ROWS = 4096  # from this many routed rows on, "auto" takes the routing permutation


@dataclass(frozen=True)
class BlockSchedule:
    sorted_P: torch.Tensor  # int32 [P_max]: routed row of each padded slot, num_rows for a pad slot
    expert_B: torch.Tensor  # int32 [B_max]: local expert of each tile (-1 past num_padded)
    num_padded_1: torch.Tensor  # int32 [1]: live slots
    block_m: int
    num_rows: int  # N: the sentinel and the number of routed rows
    p_max: int  # padded slots that can be live (grids are sized from it)
    expert_start: int = 0
    num_experts: int = 1
    is_inline: bool = False  # decode: sorted_P holds ids_N and the GEMMs derive the schedule themselves

    def kernel_args(self) -> dict:
        return dict(INLINE=self.is_inline, N_PAD=max(16, triton.next_power_of_2(self.num_rows)) if self.is_inline else 16,
                    E_PAD=max(16, triton.next_power_of_2(self.num_experts)) if self.is_inline else 16)


ScheduleFn = Callable[[torch.Tensor, int, int, int, Optional[torch.Tensor]], BlockSchedule]
SCHEDULE_BACKENDS: Registry[ScheduleFn] = Registry("fused MoE schedule backend")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@SCHEDULE_BACKENDS.register("inline")
def schedule_inline(ids_N: torch.Tensor, E: int, expert_start: int, block_m: int,
                    weights_N: Optional[torch.Tensor] = None) -> BlockSchedule:
    N = ids_N.numel()
    _check(0 < N <= MAX_INLINE_ROWS, f"the inline schedule takes 1..{MAX_INLINE_ROWS} routed rows, got {N}")
    return BlockSchedule(ids_N, ids_N, ids_N, block_m, N, N + min(E, N) * (block_m - 1), expert_start, E, True)


@SCHEDULE_BACKENDS.register("align")
def schedule_align(ids_N: torch.Tensor, E: int, expert_start: int, block_m: int,
                   weights_N: Optional[torch.Tensor] = None) -> BlockSchedule:
    N, dev = ids_N.numel(), ids_N.device
    p_max = N + min(E, N) * (block_m - 1)
    num_tiles = triton.cdiv(p_max, block_m)
    sorted_P = torch.empty(max(p_max, 1), dtype=torch.int32, device=dev)
    expert_B = torch.empty(max(num_tiles, 1), dtype=torch.int32, device=dev)
    num_padded_1 = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = max(16, triton.next_power_of_2(E))
    n_pow = triton.next_power_of_2(max(N, 1))
    sub = min(64, max(16, n_pow))  # one-hot [sub, e_pad] and pairwise [sub, sub] per step
    chunk = max(sub, triton.next_power_of_2(triton.cdiv(N, 64)))  # at most 64 chunks, in parallel
    num_chunks = max(1, triton.cdiv(N, chunk))
    is_single = num_chunks == 1
    counts_CE = sorted_P if is_single else torch.empty(num_chunks, e_pad, dtype=torch.int32, device=dev)
    pdl = use_pdl(ids_N)
    if not is_single:
        align_count_kernel[(num_chunks,)](ids_N, counts_CE, N, expert_start, E, CHUNK=chunk, SUB=sub, E_PAD=e_pad,
                                          num_warps=8, **pdl)
    align_scatter_kernel[(num_chunks,)](
        ids_N, counts_CE, sorted_P, expert_B, num_padded_1, N, expert_start, E, num_chunks, num_tiles,
        BLOCK_M=block_m, CHUNK=chunk, SUB=sub, E_PAD=e_pad, C_PAD=max(2, triton.next_power_of_2(num_chunks)),
        TILE_SUB=min(64, 8192 // e_pad), IS_SINGLE=is_single, num_warps=8, **pdl,
    )
    return BlockSchedule(sorted_P, expert_B, num_padded_1, block_m, N, p_max, expert_start, E)


@SCHEDULE_BACKENDS.register("permute")
def schedule_permute(ids_N: torch.Tensor, E: int, expert_start: int, block_m: int,
                     weights_N: Optional[torch.Tensor] = None) -> BlockSchedule:
    """The routing package's padded layout (its Triton kernels; its own format is this one)."""
    import moe_infer.routing.triton_permute  # noqa: F401  registers PERMUTE_BACKENDS["triton"]
    from moe_infer.routing.permute import permute_rows

    N = ids_N.numel()
    w_N = weights_N if weights_N is not None else torch.zeros(N, dtype=torch.float32, device=ids_N.device)
    layout = permute_rows(ids_N.view(N, 1), w_N.reshape(N, 1), E, expert_start, block_m, backend="triton").layout
    return BlockSchedule(layout.sorted_rows_P, layout.block_expert_B, layout.num_padded, block_m, N,
                         layout.sorted_rows_P.numel(), expert_start, E)


def auto_schedule_backend(num_rows: int, num_experts: int, allow_inline: bool) -> str:
    """Few rows and experts: no launch (inline; measured slower than a launch once each program's
    [N_PAD, N_PAD + E_PAD] work grows, e.g. qwen3 T=8 196 vs 178 us); many rows: the routing
    permutation; between: our align kernels."""
    n_pad, e_pad = max(16, triton.next_power_of_2(num_rows)), max(16, triton.next_power_of_2(num_experts))
    if allow_inline and 0 < num_rows <= MAX_INLINE_ROWS and n_pad * (n_pad + e_pad) <= MAX_INLINE_WORK:
        return "inline"
    return "permute" if num_rows >= PERMUTE_MIN_ROWS else "align"


def block_schedule(ids_N: torch.Tensor, num_local_experts: int, expert_start: int, block_m: int,
                   allow_inline: bool = False, backend: str = "auto",
                   weights_N: Optional[torch.Tensor] = None) -> BlockSchedule:
    """Rows of local experts grouped by expert, each group padded to a multiple of block_m.

    backend "auto": `auto_schedule_backend`; allow_inline lets it pick "inline" (the GEMMs then
    derive the schedule). weights_N (optional, [N]) saves the permute backend a zero fill."""
    _check(ids_N.dim() == 1 and not ids_N.is_floating_point(), f"ids_N must be a 1-D integer tensor, got {ids_N.dtype} {tuple(ids_N.shape)}")
    _check(num_local_experts >= 1 and block_m >= 16 and block_m & (block_m - 1) == 0,
           f"bad schedule request: num_local_experts={num_local_experts} block_m={block_m}")
    name = auto_schedule_backend(ids_N.numel(), num_local_experts, allow_inline) if backend == "auto" else backend
    if ids_N.numel() == 0:
        name = "align"  # the align kernels handle N = 0 (no live slot); the others need rows
    return SCHEDULE_BACKENDS.get(name)(ids_N.contiguous(), num_local_experts, expert_start, block_m, weights_N)
