"""Triton routing backends: registers ROUTING_BACKENDS["triton"] (fused gating), and on import the
Triton permutation (PERMUTE_BACKENDS["triton"]) and capacity ranking (RANK_BACKENDS["triton"]).

Importing needs triton but no GPU; calling needs CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1 (tests). Legend: T tokens, E experts, K top-k, G expert groups.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from moe_infer.kernels.pdl import use_pdl
from moe_infer.kernels.routing_gate import routing_gate_kernel
from moe_infer.routing import triton_capacity, triton_permute  # noqa: F401  (register on import)
from moe_infer.routing.select import ROUTING_BACKENDS
from moe_infer.routing.spec import RoutingSpec
from moe_infer.routing.triton_common import check_triton_device
from moe_infer.routing.triton_permute import PDL_ENV

MAX_EXPERTS = 1024
MAX_TOP_K = 32
LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gate_launch_config(num_tokens: int, num_experts: int) -> Tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, num_warps): about 512 scores per warp, one warp for E <= 512. The kernel is a
    chain of ~3K (+4G) row reductions; inside one warp they are shuffles, across warps each one
    is a shared-memory round trip with barriers (4 warps x 16 tokens: 55 us at T=8192, E=256 on H100)."""
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(64, 512 // block_e, triton.next_power_of_2(num_tokens)))
    return block_t, block_e, max(1, min(8, block_t * block_e // 512))


def check_gate_inputs(logits_TE: torch.Tensor, spec: RoutingSpec, bias_E: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Validates the gate's inputs (clear errors); returns the bias made contiguous (or None)."""
    if logits_TE.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    if E != spec.num_experts:
        raise ValueError(f"router logits have {E} experts, the routing spec says {spec.num_experts}")
    if logits_TE.dtype not in LOGIT_DTYPES:
        raise TypeError(f"router logits must be float32/float16/bfloat16, got {logits_TE.dtype}")
    if E > MAX_EXPERTS or spec.top_k > MAX_TOP_K:
        raise ValueError(f"triton gating supports E <= {MAX_EXPERTS}, K <= {MAX_TOP_K}; got E={E}, K={spec.top_k}")
    check_triton_device("router logits", logits_TE)
    if bias_E is not None:
        if bias_E.shape != (E,):
            raise ValueError(f"score bias must be [E={E}], got shape {tuple(bias_E.shape)}")
        if bias_E.device != logits_TE.device:
            raise ValueError(f"score bias is on {bias_E.device}, router logits on {logits_TE.device}")
        bias_E = bias_E.contiguous()
    return bias_E


def launch_gate(
    logits_TE: torch.Tensor, spec: RoutingSpec, bias_E: Optional[torch.Tensor], weights_TK: torch.Tensor,
    ids_TK: torch.Tensor, block_t: int, num_warps: int, tile_counts_SE: Optional[torch.Tensor] = None,
    within_TE: Optional[torch.Tensor] = None, sorted_rows_P: Optional[torch.Tensor] = None,
    hist_SE: Optional[torch.Tensor] = None, group_tiles: int = 1,
) -> None:
    """One launch of `routing_gate_kernel` over T tokens, BLOCK_T a program (inputs already checked).
    With tile_counts_SE [S = cdiv(T, block_t), BLOCK_E] and within_TE [T, BLOCK_E] (int8) it also writes each
    program's expert histogram and, per token and expert, the program's earlier tokens choosing it, and fills sorted_rows_P (if given) with the
    sentinel T*K: the permutation's launch 1, fused. With group_tiles > 1, tile_counts_SE (zeroed) has one
    row per group_tiles programs, accumulated with atomics, and hist_SE [S, BLOCK_E] (int8) a row per program."""
    T, E = logits_TE.shape
    K, G = spec.top_k, spec.num_expert_group
    block_e = triton.next_power_of_2(E)
    grid = (triton.cdiv(T, block_t),)
    P = sorted_rows_P.numel() if sorted_rows_P is not None else 0
    routing_gate_kernel[grid](
        logits_TE, bias_E if bias_E is not None else weights_TK, weights_TK, ids_TK,
        tile_counts_SE if tile_counts_SE is not None else ids_TK, hist_SE if hist_SE is not None else ids_TK,
        within_TE if within_TE is not None else ids_TK,
        sorted_rows_P if P else ids_TK,
        T, E, logits_TE.stride(0), logits_TE.stride(1), float(spec.routed_scaling_factor), P,
        K=K, G=G, TOPK_GROUP=spec.topk_group,
        IS_SIGMOID=spec.scoring == "sigmoid", HAS_BIAS=bias_E is not None, RENORMALIZE=spec.renormalize,
        GROUP_RESHAPE=E == block_e and G == triton.next_power_of_2(G),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(K), BLOCK_G=triton.next_power_of_2(G),
        TILE_COUNTS=tile_counts_SE is not None, FILL=triton.next_power_of_2(max(1, triton.cdiv(P, grid[0]))),
        GROUP_TILES=group_tiles,
        num_warps=num_warps, **use_pdl(logits_TE, PDL_ENV),
    )


@ROUTING_BACKENDS.register("triton")
def select_experts_triton(
    logits_TE: torch.Tensor, spec: RoutingSpec, bias_E: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `select_experts_torch`: returns topk_weights_TK (float32), topk_ids_TK (int32)."""
    bias_E = check_gate_inputs(logits_TE, spec, bias_E)
    T, E = logits_TE.shape
    weights_TK = torch.empty(T, spec.top_k, dtype=torch.float32, device=logits_TE.device)
    ids_TK = torch.empty(T, spec.top_k, dtype=torch.int32, device=logits_TE.device)
    if T == 0:
        return weights_TK, ids_TK
    block_t, _, num_warps = gate_launch_config(T, E)
    launch_gate(logits_TE, spec, bias_E, weights_TK, ids_TK, block_t, num_warps)
    return weights_TK, ids_TK
