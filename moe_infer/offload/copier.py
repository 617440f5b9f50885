"""Copies on a side stream with events, and an estimate of when the link will be idle.

On CUDA every copy into a slot runs on one side stream, after the events it must wait for (the last
compute that read the slot), and records an event the compute stream waits on before it reads the
slot (a GPU-side wait: the host never blocks on a copy). On CPU (the simulated device tier of the
tests) a copy is a plain synchronous `copy_` and events are None: the same bookkeeping runs.

`link_free_at` is the host's estimate (`clock` seconds, perf_counter unless a simulation sets its
own) of when the queued copies end, from the bandwidth: the cost model asks it whether one more miss
should wait for the link or run on the CPU. On CUDA the estimate is checked against the copies
themselves: each copy is timed by a pair of events, the ones not yet done count as backlog (the one
in progress as half done), and the measured time of the finished ones moves `bytes_per_s` toward
the rate the link really keeps in the running engine (the start-up figure is the best of a few quiet
copies; on an H100 host a copy ran about 7 % slower while the host cores computed experts,
benchmarks/trials/offload_concurrent_limits.py, and an estimate that runs ahead of the link sends
it more misses than it can take). `busy_share` is the share of the
last second or so that the queued copies kept the link busy: what a wasted prefetch costs the
copies after it.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Iterable, Optional, Sequence, Tuple

import torch

Event = Optional["torch.cuda.Event"]


class Copier:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.clock = time.perf_counter
        self.link_free_at = 0.0
        self.bytes_per_s = float("inf")  # set by the cost model once measured
        self.window_s = 1.0  # time constant of busy_share's decay
        self.busy_s, self.span_s, self.seen_at = 0.0, 0.0, None  # decayed copy seconds / elapsed seconds
        self.pending: deque = deque()  # (start event, end event, bytes) of copies not yet seen finished (CUDA)
        self.rate_weight = 0.05  # how far one finished copy moves bytes_per_s toward its measured rate
        self.min_timed_bytes = 1 << 20  # copies this small are not timed (launch-bound, not the link's rate)

    def copy(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], after: Iterable[Event] = (),
             zeros: Sequence[torch.Tensor] = ()) -> Event:
        """dst.copy_(src) for each pair on the side stream after the events `after` (and each tensor of
        `zeros` zeroed there first); the event after all of it."""
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        now = self._age()
        self.busy_s += nbytes / self.bytes_per_s
        self.link_free_at = max(now, self.link_free_at) + nbytes / self.bytes_per_s
        if not self.is_cuda:
            for dst in zeros:
                dst.zero_()
            for dst, src in pairs:
                dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            for ev in after:
                if ev is not None:
                    self.stream.wait_event(ev)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            for dst in zeros:
                dst.zero_()
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
        self.pending.append((start, ev, nbytes))
        return ev

    def wait(self, events: Iterable[Event]) -> None:
        """The compute (current) stream waits for the events: a GPU-side wait."""
        if self.is_cuda:
            stream = torch.cuda.current_stream(self.device)
            for ev in events:
                if ev is not None:
                    stream.wait_event(ev)

    def mark(self) -> Event:
        """An event after the work queued so far on the compute stream (None on CPU)."""
        if not self.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def seconds_until_idle(self) -> float:
        """The link's backlog: the bandwidth estimate, or the copies not yet finished if that is more."""
        self._drain()
        wait = max(0.0, self.link_free_at - self.clock())
        if self.pending:
            left = sum(n for _, _, n in self.pending) - self.pending[0][2] / 2  # the first one is under way
            wait = max(wait, left / self.bytes_per_s)
        return wait

    def _drain(self) -> None:
        """Finished copies leave `pending`; each large one's measured rate moves bytes_per_s."""
        while self.pending and self.pending[0][1].query():
            start, end, nbytes = self.pending.popleft()
            if nbytes >= self.min_timed_bytes and math.isfinite(self.bytes_per_s):
                seconds = start.elapsed_time(end) / 1e3
                if seconds > 0:
                    self.bytes_per_s += self.rate_weight * (nbytes / seconds - self.bytes_per_s)

    def _age(self) -> float:
        """Decay the busy and elapsed sums to now; returns now."""
        now = self.clock()
        if self.seen_at is not None:
            dt = max(now - self.seen_at, 0.0)
            f = math.exp(-dt / self.window_s)
            self.busy_s, self.span_s = self.busy_s * f, self.span_s * f + self.window_s * (1.0 - f)
        self.seen_at = now
        return now

    def busy_share(self) -> float:
        """Copy seconds queued over elapsed seconds, both decayed (1.0 before any time has passed)."""
        self._age()
        return min(1.0, self.busy_s / self.span_s) if self.span_s > 0 else 1.0
