"""PyTorch references of the fused MoE kernels, one per launch wrapper, same signatures.

They follow fused_moe.py's contracts exactly (block-padded schedule, act_PF on padded slots, y_ND
written only at routed rows of local experts), loop on the host and are meant for tests.

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k, N = T*K routed rows,
P padded slots, B tiles.
"""
from __future__ import annotations

from typing import Optional

import torch

from moe_infer.kernels.fused_moe import BlockSchedule, TailCombine
from moe_infer.kernels.fused_moe_config import FusedMoEConfig, GemmConfig
from moe_infer.kernels.moe_epilogue import SWIGLU, Epilogue


def block_schedule_ref(ids_N: torch.Tensor, num_local_experts: int, expert_start: int, block_m: int) -> BlockSchedule:
    N, E = ids_N.numel(), num_local_experts
    p_max = N + min(E, N) * (block_m - 1)
    sorted_P = torch.full((max(p_max, 1),), -7, dtype=torch.int32)
    expert_B = torch.full((max(-(-p_max // block_m), 1),), -1, dtype=torch.int32)
    slot = 0
    for e in range(E):
        rows = [n for n in range(N) if int(ids_N[n]) >= 0 and int(ids_N[n]) - expert_start == e]
        if not rows:
            continue
        padded = -(-len(rows) // block_m) * block_m
        sorted_P[slot:slot + padded] = N
        sorted_P[slot:slot + len(rows)] = torch.tensor(rows, dtype=torch.int32)
        expert_B[slot // block_m:(slot + padded) // block_m] = e
        slot += padded
    return BlockSchedule(sorted_P.to(ids_N.device), expert_B.to(ids_N.device),
                         torch.tensor([slot], dtype=torch.int32, device=ids_N.device), block_m, N, p_max,
                         expert_start, E)


def gate_up_ref(x_SD: torch.Tensor, w13_E2FD: torch.Tensor, sched: BlockSchedule, row_div: int, cfg: GemmConfig,
                epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    epilogue = epilogue or SWIGLU
    act_PF = torch.zeros(max(sched.p_max, 1), w13_E2FD.shape[1] // 2, dtype=x_SD.dtype, device=x_SD.device)
    for p in range(int(sched.num_padded_1)):
        r = int(sched.sorted_P[p])
        if r < sched.num_rows:
            e = int(sched.expert_B[p // sched.block_m])
            act_PF[p] = epilogue.gate_up_ref(w13_E2FD[e].float() @ x_SD[r // row_div].float(), e).to(x_SD.dtype)
    return act_PF


def down_ref(act_PF: torch.Tensor, w2_EDF: torch.Tensor, weights_N: torch.Tensor, sched: BlockSchedule,
             cfg: GemmConfig, y_ND: Optional[torch.Tensor] = None, tail: Optional[TailCombine] = None,
             epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    epilogue = epilogue or SWIGLU
    if y_ND is None:
        y_ND = torch.zeros(sched.num_rows, w2_EDF.shape[1], dtype=act_PF.dtype, device=act_PF.device)
    for p in range(int(sched.num_padded_1)):
        r = int(sched.sorted_P[p])
        if r < sched.num_rows:
            e = int(sched.expert_B[p // sched.block_m])
            y = epilogue.down_ref(w2_EDF[e].float() @ act_PF[p].float(), e)
            y_ND[r] = (y * weights_N.reshape(-1)[r].float()).to(y_ND.dtype)
    if tail is not None:  # the combine in the epilogue: tokens without a local row keep their zeros
        tail.out_TD.copy_(combine_topk_ref(y_ND, tail.ids_TK, sched.num_experts, sched.expert_start))
    return y_ND


def combine_topk_ref(y_ND: torch.Tensor, ids_TK: torch.Tensor, num_local_experts: int, expert_start: int) -> torch.Tensor:
    key_TK = ids_TK.long() - expert_start
    is_local_TK = (ids_TK >= 0) & (key_TK >= 0) & (key_TK < num_local_experts)
    y_TKD = y_ND.view(*ids_TK.shape, -1).float() * is_local_TK[..., None]
    return y_TKD.sum(1).to(y_ND.dtype)


def fused_experts_ref(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                      w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor, expert_start: int = 0,
                      config: Optional[FusedMoEConfig] = None, epilogue: Optional[Epilogue] = None) -> torch.Tensor:
    """Per (token, k) in float32: sum_k w * down(silu(gate(x)) * up(x)) over local experts (an epilogue: the
    biases and activation of moe_epilogue.py, w * (down(act(gate_up(x) + b13)) + b2))."""
    epilogue = epilogue or SWIGLU
    E = w13_E2FD.shape[0]
    out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    key_TK = topk_ids_TK.long() - expert_start
    for e in range(E):
        t_idx, k_idx = torch.nonzero((key_TK == e) & (topk_ids_TK >= 0), as_tuple=True)
        if t_idx.numel() == 0:
            continue
        h = x_TD[t_idx].float() @ w13_E2FD[e].float().t()
        y = epilogue.down_ref(epilogue.gate_up_ref(h, e) @ w2_EDF[e].float().t(), e)
        out_TD.index_add_(0, t_idx, y * topk_weights_TK[t_idx, k_idx].float()[:, None])
    return out_TD.to(x_TD.dtype)
