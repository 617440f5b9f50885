"""Timers of the expert-parallel benchmark: CUDA-graph replay and eager loops, the slowest rank's time.

graph(fn): fn warmed up on a side stream, captured once (NCCL collectives included), replayed
`iters` times with device events around every replay; the median replay, max over ranks. This is
the GPU's time: no host launch overhead. eager(fn): device events around a loop of `iters` calls
(host launch overhead included); the mean call, max over ranks. A barrier (synchronize +
all-reduce) separates measurements. On CPU both are wall-clock loops (graph = eager).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


class Timer:
    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup], iters: int) -> None:
        self.device, self.group, self.iters = device, group, iters
        self.cuda = device.type == "cuda"

    def barrier(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        if self.group is not None:
            t = torch.zeros(1, device=self.device)
            dist.all_reduce(t, group=self.group)
            if self.cuda:
                torch.cuda.synchronize()

    def _slowest(self, us: float) -> float:
        if self.group is None:
            return us
        t = torch.tensor([us], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def eager(self, fn: Callable[[], object]) -> float:
        for _ in range(2):
            fn()
        self.barrier()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.iters):
                fn()
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3 / self.iters
        else:
            t0 = time.perf_counter()
            for _ in range(self.iters):
                fn()
            us = (time.perf_counter() - t0) * 1e6 / self.iters
        return self._slowest(us)

    def graph(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            return self.eager(fn)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        self.barrier()
        graph.replay()
        self.barrier()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters + 1)]
        events[0].record()
        for i in range(self.iters):
            graph.replay()
            events[i + 1].record()
        events[-1].synchronize()
        us = statistics.median(events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(self.iters))
        self.barrier()
        del graph
        return self._slowest(us)
