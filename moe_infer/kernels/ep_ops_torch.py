"""The expert-parallel row operations in PyTorch: the CPU (gloo) path of the all-to-all dispatchers
(`EP_ROW_OPS["torch"]`), and the references the Triton kernels (`moe_infer.kernels.ep_ops`, same
signatures) are tested against. No host sync in any of them.

Legend: T tokens, D hidden, K top-k, N = T*K routed rows, V slots, C capacity rows per slot,
X rows of the send / receive buffer, W weight columns.
"""
from __future__ import annotations

from typing import Tuple

import torch

from moe_infer.routing.capacity_ops import expert_ranks_torch


def weight_columns(dtype: torch.dtype) -> int:
    """Payload columns that carry a row's float32 routing weight."""
    size = torch.empty((), dtype=dtype).element_size()
    if 4 % size:
        raise ValueError(f"cannot carry float32 weights in {dtype} columns")
    return 4 // size


def slot_rows_torch(ids_N: torch.Tensor, rank_N: torch.Tensor, table_V: torch.Tensor, capacity: int,
                  num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dest_N int64, src_X int32): routed row n with id >= 0 and 0 <= rank_N[n] < capacity goes to
    send row table_V[ids_N[n]] * capacity + rank_N[n]; other rows get num_rows (X, the sentinel).
    src_X[x] is the routed row sent to row x, -1 for an empty row."""
    ids = ids_N.long()
    slot_N = table_V.long()[ids.clamp_min(0)]
    is_kept_N = (ids >= 0) & (rank_N >= 0) & (rank_N < capacity)
    dest_N = torch.where(is_kept_N, slot_N * capacity + rank_N.long(), torch.full_like(ids, num_rows))
    src_X1 = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=ids.device)
    src_X1.index_put_((dest_N,), torch.arange(ids.numel(), dtype=torch.int32, device=ids.device))
    return dest_N, src_X1[:num_rows]


def pack_rows_torch(x_TD: torch.Tensor, weights_N: torch.Tensor, src_X: torch.Tensor, top_k: int,
                  out_XC: torch.Tensor) -> torch.Tensor:
    """out_XC[x] = [x_TD[src_X[x] // top_k], float32 bits of weights_N[src_X[x]]], zeros where src_X < 0.
    out_XC is [X, D + W] in x_TD's dtype; returned."""
    D = x_TD.shape[1]
    src_X = src_X.long()
    is_src_X = src_X >= 0
    safe_X = src_X.clamp_min(0)
    rows_XD = x_TD.index_select(0, safe_X // top_k) if x_TD.shape[0] else x_TD.new_zeros(src_X.numel(), D)
    out_XC[:, :D] = torch.where(is_src_X[:, None], rows_XD, torch.zeros((), dtype=x_TD.dtype, device=x_TD.device))
    w_X = weights_N.float().index_select(0, safe_X) if weights_N.numel() else weights_N.new_zeros(src_X.numel())
    w_X = torch.where(is_src_X, w_X.float(), torch.zeros((), device=w_X.device))
    out_XC[:, D:] = w_X.view(out_XC.dtype).view(src_X.numel(), out_XC.shape[1] - D)
    return out_XC


def recv_rows_torch(recv_XC: torch.Tensor, slot_X: torch.Tensor, hidden: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids_X int32, weights_X float32): each received row's local slot (-1 where its weight is 0: an
    empty capacity row, or a row whose output is zero anyway) and its float32 weight."""
    w_X = recv_XC[:, hidden:].contiguous().view(torch.float32).view(-1)
    ids_X = torch.where(w_X != 0, slot_X.to(torch.int32), torch.full_like(slot_X, -1, dtype=torch.int32))
    return ids_X, w_X


def combine_rows_torch(y_XD: torch.Tensor, dest_N: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """out_TD[t] = sum over k of y_XD[dest_N[t*K + k]] (float32 sum); rows with dest >= X add nothing."""
    X, D = y_XD.shape
    y_X1D = torch.cat([y_XD, y_XD.new_zeros(1, D)])
    y_TKD = y_X1D.index_select(0, dest_N.long().clamp_max(X)).view(num_tokens, top_k, D)
    return y_TKD.sum(dim=1, dtype=torch.float32).to(y_XD.dtype)


def slot_pack_torch(x_TD: torch.Tensor, ids_N: torch.Tensor, weights_N: torch.Tensor, slots_V3: torch.Tensor,
                  ep_rank: int, capacity: int, top_k: int, out_XC: torch.Tensor, dest_N: torch.Tensor,
                  v_start: int = 0) -> torch.Tensor:
    """Replica choice, rank within the slot, send row and pack in one op, for the virtual slots
    [v_start, v_start + V_m) whose rows out_XC ([V_m * capacity, D + W]) holds; returns dest_N.

    slots_V3 (int [V, 3]): per virtual slot v its logical expert e, replica index j and e's replica count M.
    Routed row n with id e >= 0 goes to the v of e with j == (n + ep_rank) % M; its rank among v's rows
    (row order) r gives dest_N[n] = v * capacity + r if r < capacity, else X = V * capacity (not sent).
    Only the rows of these slots get their dest_N entry (int64, written in place), and rows with id < 0
    (dest X) when v_start is 0. out_XC gets the slots' rows as `pack_rows_torch` writes them (zeros where empty)."""
    N, V, C = ids_N.numel(), slots_V3.shape[0], capacity
    V_m = out_XC.shape[0] // C
    ids = ids_N.reshape(-1).long()
    s_V3 = slots_V3.long()
    pick_NV = (torch.arange(N, device=ids.device)[:, None] + ep_rank) % s_V3[None, :, 2].clamp_min(1)
    match_NV = (ids[:, None] == s_V3[None, :, 0]) & (pick_NV == s_V3[None, :, 1])
    v_N = torch.where(match_NV.any(1), match_NV.int().argmax(1), torch.full_like(ids, -1))
    rank_N, _ = expert_ranks_torch(v_N.view(N, 1), V)  # rank among the rows of the same slot, row order
    ident_V = torch.arange(V, dtype=torch.int64, device=ids.device)
    all_dest_N, src_X = slot_rows_torch(v_N, rank_N, ident_V, C, V * C)
    mine_N = ((v_N >= v_start) & (v_N < v_start + V_m)) | ((v_N < 0) & (v_start == 0))
    dest_N.copy_(torch.where(mine_N, all_dest_N, dest_N))
    pack_rows_torch(x_TD, weights_N, src_X[v_start * C:(v_start + V_m) * C], top_k, out_XC)
    return dest_N
