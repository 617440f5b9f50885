"""The exact all-to-all dispatcher: counts first, then the payload with exact split sizes.

Per layer call: one tiny all-to-all of per-(rank, slot) row counts (with a header that checks
every rank runs the same number of micro-batches) and one host sync to turn them into split sizes;
then one payload all-to-all per micro-batch each way. No padding, no dropping: any T per rank.
The send buffer is written by one kernel (`pack_rows`, rows in (micro-batch, rank, slot) order);
the received rows of each source come sorted by slot, so the fused experts path takes them as
they lie (their slots from the counts), and the combine is one all-to-all back + `combine_rows`.

Legend: T tokens, D hidden, S local slots, P = ep*S physical slots, K top-k, N = T*K routed rows,
R received rows, M micro-batches.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from moe_infer.kernels.ep_row_ops import row_ops
from moe_infer.kernels.ep_ops_torch import weight_columns
from moe_infer.parallel.all_to_all import DISPATCHERS, A2ADispatcher, RoutePlan

_HEADER = 2  # columns ahead of the counts: number of micro-batches, tokens on the sending rank


@DISPATCHERS.register("exact")
class ExactDispatcher(A2ADispatcher):
    def _plan(self, x_TD, ids_TK, weights_TK, ranges: Sequence[Tuple[int, int]], layer_tokens: int) -> RoutePlan:
        T, K = ids_TK.shape
        N, S, ep = T * K, self.num_local_experts, self.ep
        P, dev = ep * S, ids_TK.device
        v_N, valid_N = self.slots.virtual_slots(ids_TK, tuple(ranges))
        key_N = torch.where(valid_N, v_N, torch.full_like(v_N, P))
        _, order_N = torch.sort(key_N, stable=True)
        counts_V1 = torch.zeros(P + 1, dtype=torch.int64, device=dev).scatter_add_(0, key_N, torch.ones_like(key_N))
        # counts per (destination rank, local slot): virtual slot of (m, r, s) is a*ep + r*(b-a) + s-a
        send_cnt_rX = torch.empty(ep, _HEADER + S, dtype=torch.int64, device=dev)
        send_cnt_rX[:, 0] = len(ranges)
        send_cnt_rX[:, 1] = T
        for a, b in ranges:
            send_cnt_rX[:, _HEADER + a:_HEADER + b] = counts_V1[a * ep:b * ep].view(ep, b - a)
        recv_cnt_rX = torch.empty_like(send_cnt_rX)
        self._a2a(recv_cnt_rX, send_cnt_rX, None, None, async_op=False)
        host = torch.stack([send_cnt_rX, recv_cnt_rX]).cpu().tolist()  # the one host sync
        self._check_header(host[1], len(ranges), T)
        send_splits: List[List[int]] = []
        recv_splits: List[List[int]] = []
        for a, b in ranges:
            send_splits.append([sum(row[_HEADER + a:_HEADER + b]) for row in host[0]])
            recv_splits.append([sum(row[_HEADER + a:_HEADER + b]) for row in host[1]])
        num_send = sum(map(sum, send_splits))
        pos_N = torch.empty_like(order_N)
        pos_N[order_N] = torch.arange(N, device=dev)
        w_N = weights_TK.reshape(-1).float().contiguous()
        send, secs, start = [], [], 0
        for splits in send_splits:  # each micro-batch's routed rows, in send order
            send.append((order_N[start:start + sum(splits)], w_N))
            secs.append((start, start + sum(splits)))
            start += sum(splits)
        return RoutePlan(
            num_tokens=T, top_k=K, layer_tokens=layer_tokens, slot_ranges=tuple(ranges), ids_N=ids_TK,
            send_pos_N=pos_N.clamp_max(num_send),  # dropped rows sort last: all of them -> the sentinel
            num_send_rows=num_send, send_sections=tuple(secs),
            send_rows=tuple(send), send_splits=tuple(send_splits), recv_splits=tuple(recv_splits),
            recv_counts_rS=recv_cnt_rX[:, _HEADER:], capacity=0,
        )

    def _check_header(self, recv_rows: List[List[int]], num_micro_batches: int, num_tokens: int) -> None:
        bad = [(src, row[0], row[1]) for src, row in enumerate(recv_rows) if row[0] != num_micro_batches]
        if bad:
            raise RuntimeError(
                f"EP rank {self.rank} runs {num_micro_batches} micro-batch(es) for {num_tokens} tokens but ranks "
                + ", ".join(f"{src} run {m} (for {t} tokens)" for src, m, t in bad)
                + ": overlap needs the same token count on every rank (parallel.overlap_min_mb)"
            )

    def _send_buffer(self, plan: RoutePlan, x_TD: torch.Tensor, m: int) -> torch.Tensor:
        src_R, w_N = plan.send_rows[m]
        send_RC = x_TD.new_empty(src_R.numel(), x_TD.shape[1] + weight_columns(x_TD.dtype))
        return row_ops(x_TD.device).pack_rows(x_TD, w_N, src_R, plan.top_k, send_RC)

    def _recv_slots(self, plan: RoutePlan, m: int) -> torch.Tensor:
        a, b = plan.slot_ranges[m]
        recv_rs = plan.recv_counts_rS[:, a:b]
        slots = torch.arange(a, b, device=recv_rs.device).repeat(self.ep)
        return torch.repeat_interleave(slots, recv_rs.reshape(-1), output_size=sum(plan.recv_splits[m]))

    def _regroup(self, plan: RoutePlan, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = plan.slot_ranges[m]
        _, slot_order_R = torch.sort(self._recv_slots(plan, m), stable=True)
        counts_S = torch.zeros(self.num_local_experts, dtype=torch.int64, device=plan.send_pos_N.device)
        counts_S[a:b] = plan.recv_counts_rS[:, a:b].sum(0)
        return slot_order_R, counts_S
