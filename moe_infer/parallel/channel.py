"""Moving steps between the ranks: the plan's header (host), its inputs and hidden states (device), sampled tokens.

    broadcast_header(msg)     stage 0: the driver's header to every rank of the first stage (the step's one host
                              message there)
    send_header / recv_header a header from rank (s, i) to rank (s + 1, i): every rank of a stage receives from the
                              same in-stage index of the previous stage, so no later stage broadcasts
    broadcast_payload(buf)    stage 0: the driver's step inputs into the same range of every rank's buffer (where the
                              step's graphs do not broadcast them themselves: moe_infer/engine/step_paths.py)
    send_payload / recv_payload, send_hidden / recv_hidden   the inputs and the stage's output hidden states [T, D]
                              to the next stage, into the receiver's buffers
    send_result / recv        the last stage's sampled tokens to the driver (float64, CPU: the driver's scheduler
                              reads them on the host anyway)

Headers (and the host ints, inline when they fit: HOST_INLINE, 256 decoding sequences of a sampler on another rank)
and the pickled params of new requests go over the CPU (gloo) control groups, which wait as long as a rank idles
between requests; everything else over the device groups (NCCL on GPU), stream-ordered, which time out after
`parallel.timeout_s`. So a step costs one host message per rank: its header (the driver: the sampled tokens of
the last stage, with pipeline stages). The driver's sends are asynchronous (its header broadcast, `isend` from a copy
of the data between stages): it goes on with its next step (whose graphs overwrite their buffers), and keeps the
data until `retire` sees the sends through.
A failed transfer raises the mesh's `MeshError` naming the peer.

Legend: T tokens of the step, D hidden, S sampled tokens, U payload bytes.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional

import torch
import torch.distributed as dist

from moe_infer.parallel.step_message import H_NUM_HOST, H_NUM_SIDE, HEADER_LEN, StepMessage

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
    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self._sent: Deque[List] = deque()  # per step: [work, tensor, work, tensor, ...] of its isends

    def _fail(self, what: str, err: BaseException, peer: Optional[int] = None) -> BaseException:
        """The mesh's error for a failed transfer with `peer` (None: a collective over the first stage)."""
        if peer is None:
            ranks = [self.ctx.dims.rank_of(0, i) for i in range(self.ctx.dims.stage_size)]
        else:
            ranks = sorted({self.ctx.rank, peer})
        return self.ctx.failure(what, err, ranks)

    # ---- the first stage: the driver's step to its peers -------------------------------------
    def broadcast_header(self, msg: Optional[StepMessage]) -> StepMessage:
        """The driver passes its message and goes on (the broadcast runs on gloo's thread: `retire` sees it through;
        nothing is sent in a first stage of one rank); the other ranks of stage 0 pass None and wait for the header
        (+ host, side)."""
        if msg is not None:
            if self.ctx.dims.stage_size > 1:
                self._send_header_to_stage(msg)
            return msg
        ctrl = self.ctx.stage_control_group
        try:
            head = torch.empty(HEADER_LEN + HOST_INLINE, dtype=torch.int64)
            dist.broadcast(head, src=0, group=ctrl)
            header, host, h = _split(head)
            if host is None:
                host = torch.empty(h[H_NUM_HOST], dtype=torch.int64)
                dist.broadcast(host, src=0, group=ctrl)
            side = _EMPTY_SIDE
            if h[H_NUM_SIDE]:
                side = torch.empty(h[H_NUM_SIDE], dtype=torch.uint8)
                dist.broadcast(side, src=0, group=ctrl)
        except RuntimeError as err:
            raise self._fail("the step broadcast of the first stage", err, 0) from err
        return StepMessage(header, host, side)

    def _send_header_to_stage(self, msg: StepMessage) -> None:
        """The driver's side of `broadcast_header`, asynchronous, straight on the process group (dist.broadcast's
        Python layers took 2.5x the time of this call on a CPU: it is on the path of every step)."""
        ctrl, opts = self.ctx.stage_control_group, dist.BroadcastOptions()
        opts.rootRank = 0  # the driver: rank 0 of the first stage's group
        parts = [_head(msg)] + ([msg.host] if msg.host.numel() > HOST_INLINE else []) + \
            ([msg.side] if msg.side.numel() else [])
        step: List = []
        try:
            for tensor in parts:
                step += [ctrl.broadcast([tensor], opts), tensor]
        except RuntimeError as err:
            raise self._fail("the step broadcast of the first stage", err) from err
        self._sent.append(step)

    def broadcast_payload(self, buf_U: torch.Tensor) -> None:
        """The driver's step inputs (its payload) into buf_U on every rank of stage 0 (the driver passes its own)."""
        self.ctx.stage_broadcast(buf_U)

    # ---- stage s -> stage s + 1 ----------------------------------------------------------------
    def send_header(self, msg: StepMessage, dst: int) -> None:
        h = msg.header.tolist()
        parts = [(_head(msg), self.ctx.control_group)]
        parts += [(msg.host, self.ctx.control_group)] if h[H_NUM_HOST] > HOST_INLINE else []
        parts += [(msg.side, self.ctx.control_group)] if h[H_NUM_SIDE] else []
        self._isend(parts, dst, "the step plan")

    def recv_header(self, src: int) -> StepMessage:
        ctrl = self.ctx.control_group
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
        except RuntimeError as err:
            raise self._fail(f"receiving the step plan from rank {src}", err, src) from err
        return StepMessage(header, host, side)

    def send_payload(self, buf_U: torch.Tensor, dst: int) -> None:
        self._isend([(buf_U.clone(), self.ctx.world_group)], dst, "the step's inputs")

    def recv_payload(self, buf_U: torch.Tensor, src: int) -> None:
        self._recv(buf_U, src, f"receiving the step's inputs from rank {src}")

    def send_hidden(self, hidden_TD: torch.Tensor, dst: int) -> None:
        self._isend([(hidden_TD.clone(memory_format=torch.contiguous_format), self.ctx.world_group)], dst,
                    "hidden states")

    def recv_hidden(self, hidden_TD: torch.Tensor, src: int) -> None:
        self._recv(hidden_TD, src, f"receiving hidden states from rank {src} (pipeline stage "
                                   f"{self.ctx.dims.coords(src)[0]})")

    def _recv(self, tensor: torch.Tensor, src: int, what: str) -> None:
        try:
            dist.recv(tensor, src, group=self.ctx.world_group)
        except RuntimeError as err:
            raise self._fail(what, err, src) from err

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
