"""Shared pieces of the fused MoE benchmark and tuner: model shapes, inputs, roofline, timing.

Timing is CUDA-graph replay: the timed function is captured once, then each replay is timed
alone between device events; the median is reported.

Legend: T tokens (M in the issue's table), D hidden, F expert intermediate, E experts, K top-k.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Tuple

import torch

# name -> (E, K, D, F)
MODEL_SHAPES: Dict[str, Tuple[int, int, int, int]] = {
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "olmoe-1b-7b": (64, 8, 2048, 1024),
    "deepseek-v3": (256, 8, 7168, 2048),
}
TOKEN_COUNTS = (1, 8, 32, 128, 512, 2048, 8192)


def make_weights(E: int, D: int, F: int, dtype=torch.bfloat16, device="cuda"):
    w13_E2FD = torch.randn(E, 2 * F, D, device=device, dtype=dtype) * D ** -0.5
    w2_EDF = torch.randn(E, D, F, device=device, dtype=dtype) * F ** -0.5
    return w13_E2FD, w2_EDF


def make_inputs(T: int, E: int, K: int, D: int, dtype=torch.bfloat16, device="cuda", seed: int = 0):
    """Random tokens, softmax top-k routing on random logits (weights renormalised over the K)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x_TD = torch.randn(T, D, device=device, dtype=dtype, generator=gen)
    logits_TE = torch.randn(T, E, device=device, generator=gen)
    w_TK, ids_TK = torch.softmax(logits_TE, -1).topk(K, dim=-1)
    return x_TD, ids_TK.int(), (w_TK / w_TK.sum(-1, keepdim=True))


def roofline_us(ids_TK: torch.Tensor, E: int, D: int, F: int, hbm_bytes_per_s: float, flops_per_s: float,
                bytes_per_el: int = 2) -> float:
    """max(bytes of the distinct experts touched / HBM rate, 2*T*K*3*D*F flops / bf16 rate), in us; the rates are
    the device's, measured by the caller (benchmarks/device_rates.py)."""
    num_distinct = int(torch.unique(ids_TK[ids_TK >= 0]).numel())
    t_mem = num_distinct * 3 * D * F * bytes_per_el / hbm_bytes_per_s
    t_flop = 2 * ids_TK.numel() * 3 * D * F / flops_per_s
    return max(t_mem, t_flop) * 1e6


def graph_time_us(fn: Callable[[], object], num_replays: int = 30, warmup: int = 3, sustain_s: float = 0.0) -> float:
    """Median time of one replay of fn captured in a CUDA graph. sustain_s > 0: the graph is first replayed for
    that long, so the timing sees the clocks the GPU holds under sustained load (an H200 drops from 1980 MHz to
    1300-1650 MHz within tens of milliseconds of compute-bound work: docs/notes/fused_moe.md)."""
    fn()  # compile / allocate outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    if sustain_s > 0:
        torch.cuda.synchronize()
        t_end = time.perf_counter() + sustain_s
        while time.perf_counter() < t_end:
            for _ in range(4):
                graph.replay()
            torch.cuda.synchronize()
    median_us = replay_time_us(graph, num_replays)
    del graph
    return median_us


def replay_time_us(graph: torch.cuda.CUDAGraph, num_replays: int) -> float:
    """Median time of one replay of a captured graph, each replay timed alone between device events."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def replays_for(estimate_us: float) -> int:
    """Enough replays for a stable median, at most ~0.3 s per measurement."""
    return int(max(10, min(100, 3e5 / max(estimate_us, 1.0))))
