"""Moving steps between the ranks: the plan (`StepMessage`), hidden states and sampled tokens.

    broadcast(msg)        stage 0: the driver's plan to every rank of the first stage
    send / recv           a plan from rank (s, i) to rank (s + 1, i): every rank of a stage receives
                          from the same in-stage index of the previous stage, so no stage broadcasts
    send_hidden / recv_hidden   the stage's output hidden states [T, D], same pairs
    send_result / recv_result   the last stage's sampled tokens to the driver (float64, CPU)

Header, host and side parts go over the CPU (gloo) control groups, which wait as long as a rank
idles between requests; flat and hidden over the device groups (NCCL on GPU), which time out after
`parallel.timeout_s`. The host ints ride in the header's message when they fit (HOST_INLINE: 256
decoding sequences), so a step is usually two messages: header + host, then flat. Sends are asynchronous (`isend`): the sender goes on with its next batch, and
keeps the buffers until `retire` sees them through. A failed transfer raises the mesh's `MeshError`
naming the peer.

Legend: T tokens of the step, D hidden.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional

import torch
import torch.distributed as dist

from moe_infer.parallel.step_message import H_NUM_FLAT, H_NUM_HOST, H_NUM_SIDE, HEADER_LEN, StepMessage

_EMPTY_SIDE = torch.empty(0, dtype=torch.uint8)
HOST_INLINE = 1040  # host ints sent inside the header's fixed-size message (8.4 KB)


def _head(msg: StepMessage) -> torch.Tensor:
    """The fixed-size first message: the header, then the host ints when they fit."""
    head = torch.zeros(HEADER_LEN + HOST_INLINE, dtype=torch.int64)
    head[:HEADER_LEN] = msg.header
    if msg.host.numel() <= HOST_INLINE:
        head[HEADER_LEN:HEADER_LEN + msg.host.numel()] = msg.host
    return head


def _split(head: torch.Tensor):
    """(header, host or None when it comes in its own message, header as a list)."""
    header = head[:HEADER_LEN]
    h = header.tolist()
    n = h[H_NUM_HOST]
    return header, (head[HEADER_LEN:HEADER_LEN + n] if n <= HOST_INLINE else None), h


class StepChannel:
    def __init__(self, ctx, hidden_size: int, dtype: torch.dtype) -> None:
        self.ctx, self.hidden_size, self.dtype, self.device = ctx, hidden_size, dtype, ctx.device
        self._sent: Deque[List] = deque()  # per step: [work, tensor, work, tensor, ...] of its isends

    def _fail(self, what: str, err: BaseException, peer: Optional[int] = None) -> BaseException:
        """The mesh's error for a failed transfer with `peer` (None: a collective over the first stage)."""
        if peer is None:
            ranks = [self.ctx.dims.rank_of(0, i) for i in range(self.ctx.dims.stage_size)]
        else:
            ranks = sorted({self.ctx.rank, peer})
        return self.ctx.failure(what, err, ranks)

    # ---- the first stage: the driver's plan to its peers ---------------------------------------
    def broadcast(self, msg: Optional[StepMessage]) -> StepMessage:
        """The driver passes its message (flat on the device); the other ranks of stage 0 pass None."""
        ctx = self.ctx
        ctrl, data = ctx.stage_control_group, ctx.stage_group
        try:
            head = _head(msg) if msg is not None else torch.empty(HEADER_LEN + HOST_INLINE, dtype=torch.int64)
            dist.broadcast(head, src=0, group=ctrl)
            header, host, h = _split(head)
            if host is None:
                host = msg.host if msg is not None else torch.empty(h[H_NUM_HOST], dtype=torch.int64)
                dist.broadcast(host, src=0, group=ctrl)
            side = msg.side if msg is not None else torch.empty(h[H_NUM_SIDE], dtype=torch.uint8)
            if h[H_NUM_SIDE]:
                dist.broadcast(side, src=0, group=ctrl)
            flat = msg.flat if msg is not None else torch.empty(h[H_NUM_FLAT], dtype=torch.int64, device=self.device)
            if h[H_NUM_FLAT]:
                dist.broadcast(flat, src=0, group=data)
        except RuntimeError as err:
            raise self._fail("the step broadcast of the first stage", err,
                             None if msg is not None else 0) from err
        return StepMessage(header, host, side, flat)

    # ---- stage s -> stage s + 1 ----------------------------------------------------------------
    def send(self, msg: StepMessage, dst: int) -> None:
        h = msg.header.tolist()
        parts = [(_head(msg), self.ctx.control_group)]
        parts += [(msg.host, self.ctx.control_group)] if h[H_NUM_HOST] > HOST_INLINE else []
        parts += [(msg.side, self.ctx.control_group)] if h[H_NUM_SIDE] else []
        parts += [(msg.flat, self.ctx.world_group)] if h[H_NUM_FLAT] else []
        self._isend(parts, dst, "the step plan")

    def recv(self, src: int) -> StepMessage:
        ctrl, data = self.ctx.control_group, self.ctx.world_group
        try:
            head = torch.empty(HEADER_LEN + HOST_INLINE, dtype=torch.int64)
            dist.recv(head, src, group=ctrl)
            header, host, h = _split(head)
            side = _EMPTY_SIDE
            if host is None:
                host = torch.empty(h[H_NUM_HOST], dtype=torch.int64)
                dist.recv(host, src, group=ctrl)
            if h[H_NUM_SIDE]:
                side = torch.empty(h[H_NUM_SIDE], dtype=torch.uint8)
                dist.recv(side, src, group=ctrl)
            flat = torch.empty(h[H_NUM_FLAT], dtype=torch.int64, device=self.device)
            if h[H_NUM_FLAT]:
                dist.recv(flat, src, group=data)
        except RuntimeError as err:
            raise self._fail(f"receiving the step plan from rank {src}", err, src) from err
        return StepMessage(header, host, side, flat)

    def send_hidden(self, hidden_TD: torch.Tensor, dst: int) -> None:
        self._isend([(hidden_TD.contiguous(), self.ctx.world_group)], dst, "hidden states")

    def recv_hidden(self, src: int, num_tokens: int) -> torch.Tensor:
        hidden_TD = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        try:
            dist.recv(hidden_TD, src, group=self.ctx.world_group)
        except RuntimeError as err:
            raise self._fail(f"receiving hidden states from rank {src} (pipeline stage "
                             f"{self.ctx.dims.coords(src)[0]})", err, src) from err
        return hidden_TD

    # ---- the last stage -> the driver ----------------------------------------------------------
    def send_result(self, result: torch.Tensor) -> None:
        self._isend([(result, self.ctx.results_group)], 0, "sampled tokens")

    def post_result_recv(self, numel: int):
        """(work, buffer): the driver's receive of one step's sampled tokens, waited on later."""
        buf = torch.empty(numel, dtype=torch.float64)
        try:
            return dist.irecv(buf, self.ctx.sampler_rank, group=self.ctx.results_group), buf
        except RuntimeError as err:
            raise self._fail("posting the receive of sampled tokens", err, self.ctx.sampler_rank) from err

    def wait_result(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            raise self._fail(f"waiting for the sampled tokens of rank {self.ctx.sampler_rank} (the last "
                             f"pipeline stage)", err, self.ctx.sampler_rank) from err

    # ---- asynchronous sends --------------------------------------------------------------------
    def _isend(self, parts, dst: int, what: str) -> None:
        step: List = []
        try:
            for tensor, group in parts:
                step += [dist.isend(tensor, dst, group=group), tensor]
        except RuntimeError as err:
            raise self._fail(f"sending {what} to rank {dst}", err, dst) from err
        self._sent.append(step)

    def retire(self, keep: int = 0) -> None:
        """Wait for all but the last `keep` sends (their buffers are then free)."""
        while len(self._sent) > keep:
            step = self._sent.popleft()
            for work in step[::2]:
                try:
                    work.wait()
                except RuntimeError as err:
                    raise self.ctx.failure("an earlier send", err) from err
