"""Launch wrappers of the expert-parallel row kernels (`moe_infer.kernels.ep_rows`), registered as
`EP_ROW_OPS["triton"]` (`moe_infer.kernels.ep_row_ops`) when this module is imported: CUDA tensors (or CPU
tensors under TRITON_INTERPRET=1), one launch per op. A plugin module: only `load_plugins()` and the
tests import it, so the engine needs no triton on CPU.

`slot_pack` is ranks + `slot_rows` + `pack_rows` (and the replica choice) in one launch; each of its
programs scans all N routed rows, so callers use it up to `ep_row_ops.SLOT_PACK_MAX_ROWS` rows and the separate
steps above that.

Each op has the signature of its reference. The wrappers check dtypes, shapes, strides and devices
and raise ValueError naming the problem. No op synchronizes with the host.

Legend: T tokens, D hidden, K top-k, N = T*K routed rows, V slots, C capacity rows per slot,
X rows of the send / receive buffer, W weight columns.
"""
from __future__ import annotations

import os
from typing import Tuple

import torch
import triton

from moe_infer.kernels.ep_ops_torch import weight_columns
from moe_infer.kernels.ep_row_ops import EP_ROW_OPS, RowOps
from moe_infer.kernels.ep_rows import (
    combine_rows_kernel, pack_rows_kernel, recv_rows_kernel, slot_pack_kernel, slot_rows_kernel,
)
from moe_infer.kernels.pdl import use_pdl

_INT = (torch.int32, torch.int64)
PDL_ENV = "MOE_EP_PDL"  # "0": slot_pack launches without programmatic dependent launch


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_device(t: torch.Tensor, name: str, like: torch.Tensor) -> None:
    _check(t.device == like.device, f"{name} is on {t.device}, expected {like.device}")
    _check(t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1",
           f"{name}: the Triton EP row kernels need CUDA tensors (or TRITON_INTERPRET=1), got {t.device}")


def _check_index(t: torch.Tensor, name: str, numel: int, like: torch.Tensor) -> None:
    _check(t.dtype in _INT and t.dim() == 1 and t.numel() == numel and t.is_contiguous(),
           f"{name} must be a contiguous 1-D int32/int64 tensor of {numel} entries, got {t.dtype} {tuple(t.shape)}")
    _check_device(t, name, like)


def _float32_view(buf_XC: torch.Tensor, hidden: int) -> Tuple[torch.Tensor, int, int]:
    """(the buffer seen as float32, its row stride in float32 elements, the weight column there)."""
    size = buf_XC.element_size()
    _check((hidden * size) % 4 == 0, f"hidden size {hidden} in {buf_XC.dtype}: the float32 weight columns must "
           f"start 4-byte aligned (hidden a multiple of {4 // size})")
    try:
        buf_f = buf_XC.view(torch.float32)
    except RuntimeError as err:
        raise ValueError(f"a {tuple(buf_XC.shape)} {buf_XC.dtype} buffer with strides {buf_XC.stride()} cannot "
                         f"be seen as float32 rows: {err}") from err
    return buf_f, buf_f.stride(0), hidden * size // 4


def slot_rows_triton(ids_N, rank_N, table_V, capacity: int, num_rows: int):
    N = ids_N.numel()
    _check_index(ids_N, "ids_N", N, ids_N)
    _check_index(rank_N, "rank_N", N, ids_N)
    _check_index(table_V, "table_V", table_V.numel(), ids_N)
    _check(capacity > 0 and num_rows >= 0, f"capacity ({capacity}) must be positive, num_rows ({num_rows}) >= 0")
    dest_N = torch.empty(N, dtype=torch.int64, device=ids_N.device)
    src_X = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=ids_N.device)
    if N:
        slot_rows_kernel[(triton.cdiv(N, 256),)](ids_N, rank_N, table_V, dest_N, src_X, N, capacity, num_rows,
                                                 BLOCK_N=256, num_warps=4)
    return dest_N, src_X[:num_rows]


def pack_rows_triton(x_TD, weights_N, src_X, top_k: int, out_XC):
    T, D = x_TD.shape
    X = src_X.numel()
    W = weight_columns(x_TD.dtype)
    _check(x_TD.stride(1) == 1, f"x_TD needs a unit last stride, got strides {x_TD.stride()}")
    _check(weights_N.dtype == torch.float32 and weights_N.is_contiguous() and weights_N.numel() == T * top_k,
           f"weights_N must be contiguous float32 [{T * top_k}], got {weights_N.dtype} {tuple(weights_N.shape)}")
    _check(out_XC.shape == (X, D + W) and out_XC.dtype == x_TD.dtype,
           f"out_XC must be [{X}, {D + W}] {x_TD.dtype}, got {tuple(out_XC.shape)} {out_XC.dtype}")
    _check_index(src_X, "src_X", X, x_TD)
    _check_device(weights_N, "weights_N", x_TD)
    _check_device(out_XC, "out_XC", x_TD)
    out_w, stride_ow, w_col = _float32_view(out_XC, D)
    block_d = min(2048, triton.next_power_of_2(max(D, 16)))
    if X:
        pack_rows_kernel[(X, triton.cdiv(D, block_d))](
            x_TD, weights_N, src_X, out_XC, out_w, D, top_k, x_TD.stride(0), out_XC.stride(0), stride_ow, w_col,
            BLOCK_D=block_d, num_warps=4)
    return out_XC


def recv_rows_triton(recv_XC, slot_X, hidden: int):
    X = recv_XC.shape[0]
    _check(recv_XC.dim() == 2 and recv_XC.shape[1] == hidden + weight_columns(recv_XC.dtype),
           f"recv_XC must be [X, {hidden} + weight columns], got {tuple(recv_XC.shape)} {recv_XC.dtype}")
    _check_index(slot_X, "slot_X", X, recv_XC)
    _check_device(recv_XC, "recv_XC", recv_XC)
    recv_w, stride_w, w_col = _float32_view(recv_XC, hidden)
    ids_X = torch.empty(X, dtype=torch.int32, device=recv_XC.device)
    w_X = torch.empty(X, dtype=torch.float32, device=recv_XC.device)
    if X:
        recv_rows_kernel[(triton.cdiv(X, 1024),)](recv_w, slot_X, ids_X, w_X, X, stride_w, w_col, BLOCK_X=1024,
                                                  num_warps=4)
    return ids_X, w_X


def combine_rows_triton(y_XD, dest_N, num_tokens: int, top_k: int):
    X, D = y_XD.shape
    _check(y_XD.stride(1) == 1, f"y_XD needs a unit last stride, got strides {y_XD.stride()}")
    _check_index(dest_N, "dest_N", num_tokens * top_k, y_XD)
    _check_device(y_XD, "y_XD", y_XD)
    out_TD = torch.empty(num_tokens, D, dtype=y_XD.dtype, device=y_XD.device)
    block_d = min(1024, triton.next_power_of_2(max(D, 16)))
    if num_tokens:
        combine_rows_kernel[(num_tokens, triton.cdiv(D, block_d))](
            y_XD, dest_N, out_TD, D, X, y_XD.stride(0), out_TD.stride(0), K=top_k, BLOCK_D=block_d, num_warps=4)
    return out_TD


def slot_pack_triton(x_TD, ids_N, weights_N, slots_V3, ep_rank: int, capacity: int, top_k: int, out_XC, dest_N,
                     v_start: int = 0):
    T, D = x_TD.shape
    N, V = ids_N.numel(), slots_V3.shape[0]
    W = weight_columns(x_TD.dtype)
    _check(capacity > 0 and top_k > 0, f"capacity ({capacity}) and top_k ({top_k}) must be positive")
    _check(N == T * top_k, f"ids_N has {N} routed rows, x_TD {T} tokens x top_k {top_k}")
    _check_index(ids_N, "ids_N", N, x_TD)
    _check(dest_N.dtype == torch.int64 and dest_N.shape == (N,) and dest_N.is_contiguous(),
           f"dest_N must be contiguous int64 [{N}], got {dest_N.dtype} {tuple(dest_N.shape)}")
    _check_device(dest_N, "dest_N", x_TD)
    _check(slots_V3.dtype == torch.int32 and slots_V3.dim() == 2 and slots_V3.shape[1] == 3 and slots_V3.is_contiguous(),
           f"slots_V3 must be contiguous int32 [V, 3], got {slots_V3.dtype} {tuple(slots_V3.shape)}")
    _check_device(slots_V3, "slots_V3", x_TD)
    _check(x_TD.stride(1) == 1, f"x_TD needs a unit last stride, got strides {x_TD.stride()}")
    _check(weights_N.dtype == torch.float32 and weights_N.is_contiguous() and weights_N.numel() == N,
           f"weights_N must be contiguous float32 [{N}], got {weights_N.dtype} {tuple(weights_N.shape)}")
    _check_device(weights_N, "weights_N", x_TD)
    V_m = out_XC.shape[0] // capacity
    _check(out_XC.dim() == 2 and out_XC.shape == (V_m * capacity, D + W) and out_XC.dtype == x_TD.dtype
           and 0 <= v_start and v_start + V_m <= V,
           f"out_XC must be [V_m * {capacity}, {D + W}] {x_TD.dtype} for slots [v_start, v_start + V_m) of {V} "
           f"(v_start={v_start}), got {tuple(out_XC.shape)} {out_XC.dtype}")
    _check_device(out_XC, "out_XC", x_TD)
    out_w, stride_ow, w_col = _float32_view(out_XC, D)
    src_X = torch.empty(max(V_m * capacity, 1), dtype=torch.int32, device=x_TD.device)  # scratch, per program
    block_d = min(1024, triton.next_power_of_2(max(D, 16)))
    block_c = max(1, min(triton.next_power_of_2(capacity), 8192 // block_d))
    if V_m:
        slot_pack_kernel[(V_m,)](
            ids_N, slots_V3, x_TD, weights_N, dest_N, src_X, out_XC, out_w, N, capacity, V * capacity, D, top_k,
            ep_rank, v_start, x_TD.stride(0), out_XC.stride(0), stride_ow, w_col,
            BLOCK_N=min(1024, max(16, triton.next_power_of_2(N))), BLOCK_C=block_c, BLOCK_D=block_d, num_warps=4,
            **use_pdl(x_TD, PDL_ENV))
    return dest_N


EP_ROW_OPS.register("triton")(RowOps(slot_rows_triton, pack_rows_triton, recv_rows_triton, combine_rows_triton,
                                     slot_pack_triton))
