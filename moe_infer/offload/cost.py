"""The measured cost model: for each missed expert, copy it over the link or compute it on the CPU.

Measured once at start-up on this machine (`CostModel.measure`): the host-to-device bandwidth of one
expert copy from the host tier, the CPU's time for one expert at 1, 4, 16 and 64 rows (interpolated
in between, linear beyond), the same for its gate/up projections alone (what the host computes of an
expert it shares with the link, offload/split.py), and, for the NVMe tier, the disk read bandwidth of
one expert record.
The start-up figures are the best of a few quiet runs; in the running engine the host thread that
computes a missed expert is also the one that launches the GPU's work, its cores wake from idle and
the rows travel both ways, so the CPU path's measured wall time per step (`observe_cpu`) rescales the
CPU side of the model (`cpu_scale`, a running average of measured / predicted), and a layer step
that sends no miss to the CPU lets the scale drift back toward the start-up figures (`relax`), so
a host that was slow once is measured again.
`split_misses` is list scheduling over two servers, the link and the host cores: experts with the
most rows first, each where it would finish earliest given what is already queued on the link
(in-flight prefetches included). Miss policy `wait` sends every miss to the link, `cpu` every one to
the host; `auto` decides by the model (Fiddler's rule, per expert and row count).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from moe_infer.offload.compute import gate_up, swiglu

logger = logging.getLogger(__name__)
_ROWS = (1, 4, 16, 64)


@dataclass
class CostModel:
    h2d_bytes_per_s: float
    cpu_seconds_at: Tuple[Tuple[int, float], ...]  # (rows, seconds for one expert)
    read_bytes_per_s: float = float("inf")  # NVMe tier
    cpu_scale: float = 1.0  # measured / predicted CPU path time in the running engine (observe_cpu)
    # (rows, seconds for one expert's gate/up projections alone, all F); None: 2/3 of cpu_seconds_at (bytes)
    cpu13_seconds_at: Optional[Tuple[Tuple[int, float], ...]] = None

    def cpu_seconds(self, rows: int) -> float:
        return self.cpu_scale * _interpolate(self.cpu_seconds_at, rows)

    def cpu13_seconds(self, rows: int) -> float:
        """The host's time for one expert's gate/up projections (all F of them) at `rows` rows."""
        return self.cpu_scale * self._cpu13_at_start(rows)

    def _cpu13_at_start(self, rows: int) -> float:
        if self.cpu13_seconds_at is None:
            return _interpolate(self.cpu_seconds_at, rows) * 2.0 / 3.0
        return _interpolate(self.cpu13_seconds_at, rows)

    def observe_cpu(self, rows: List[int], seconds: float, weight: float = 0.25,
                    shares: Optional[List[float]] = None) -> None:
        """One step's CPU path took `seconds` (host wall time: rows out, experts computed, result queued)
        for experts of `rows` rows each: move cpu_scale toward measured / start-up prediction. shares[i]:
        the part of expert i's gate/up rows the host computed when it shared the expert with the link
        (None: it computed the whole expert)."""
        shares = shares or [None] * len(rows)
        predicted = sum(_interpolate(self.cpu_seconds_at, n) if f is None else f * self._cpu13_at_start(n)
                        for n, f in zip(rows, shares))
        if predicted > 0 and seconds > 0:
            ratio = min(max(seconds / predicted, 0.25), 100.0)
            self.cpu_scale += weight * (ratio - self.cpu_scale)

    def relax(self, rate: float = 0.01) -> None:
        """A layer step's misses all went to the link: cpu_scale drifts back toward the start-up
        figures (1.0). Only the CPU path's own runs measure it, so without this a host measured slow
        once (a busy moment, a burst of wide steps) would never get a miss again and never be measured
        again; now it is tried again after a while (at 0.01 a layer step, a scale's excess over 1
        halves in about 70 layer steps) and `observe_cpu` tells whether it is still slow."""
        self.cpu_scale += rate * (1.0 - self.cpu_scale)

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s

    def describe(self, expert_bytes: int, device_type: str = "cuda") -> str:
        """One line of the figures; without a GPU (device_type "cpu") no H2D figure: the "device" slots are host
        memory, and a host-to-host copy's speed said as H2D GB/s misled."""
        cpu = ", ".join(f"{t * 1e3:.2f} ms @{n}" for n, t in self.cpu_seconds_at)
        if self.cpu13_seconds_at is not None:
            cpu += " (gate/up alone " + ", ".join(f"{t * 1e3:.2f} ms @{n}" for n, t in self.cpu13_seconds_at)
            cpu += ")"
        read = "" if self.read_bytes_per_s == float("inf") else f", disk read {self.read_bytes_per_s / 1e9:.2f} GB/s"
        scale = "" if self.cpu_scale == 1.0 else f" (x{self.cpu_scale:.2f} as measured in the engine)"
        link = (f"H2D {self.h2d_bytes_per_s / 1e9:.1f} GB/s ({self.copy_seconds(expert_bytes) * 1e3:.2f} ms per expert)"
                if device_type == "cuda" else "no GPU (no H2D link)")
        return f"offload cost model: {link}, CPU expert {cpu} rows{scale}{read}"

    @classmethod
    def measure(cls, nbytes: int, host_weights: Callable[[], Tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
                copy: Callable[[], None], sync: Callable[[], None], repeats: int = 5) -> "CostModel":
        """copy() moves one expert's `nbytes` (as stored) from the host tier to a device slot; host_weights()
        gives its (w13, w2) for the host's compute in dtype (a quantized expert dequantized: timed with it)."""

        def best(fn: Callable[[], None]) -> float:  # the fastest of a few runs: robust to a busy host
            fn()
            sync()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - t0)
            return max(min(times), 1e-9)

        h2d = nbytes / best(copy)
        points, points13 = [], []
        for rows in _ROWS:
            w13, w2 = host_weights()
            x = torch.randn(rows, w13.shape[1]).to(dtype)
            points.append((rows, best(lambda: swiglu(x, *host_weights()))))
            points13.append((rows, best(lambda: gate_up(x, host_weights()[0], w2.shape[1]))))
        return cls(h2d, tuple(points), cpu13_seconds_at=tuple(points13))


def _interpolate(pts: Tuple[Tuple[int, float], ...], rows: int) -> float:
    """Piecewise linear in the row count through the measured points, linear beyond the last two."""
    for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
        if rows <= n1:
            return t0 + (t1 - t0) * max(rows - n0, 0) / (n1 - n0)
    (n0, t0), (n1, t1) = pts[-2], pts[-1]
    return t1 + (t1 - t0) * (rows - n1) / (n1 - n0)


def split_misses(misses: Dict[int, int], mode: str, cost: CostModel, expert_bytes: int, link_wait_s: float,
                 needs_read: Callable[[int], bool] = lambda e: False, cpu_lead_s: float = 0.0
                 ) -> Tuple[List[int], List[int]]:
    """(experts to copy, experts to compute on the CPU) for misses {expert: rows}; the link is free in
    link_wait_s, the host cores in cpu_lead_s."""
    if mode == "wait":
        return sorted(misses), []
    if mode == "cpu":
        return [], sorted(misses)
    link, cpu, disk = link_wait_s, cpu_lead_s, 0.0
    to_copy, to_cpu = [], []
    read_s = expert_bytes / cost.read_bytes_per_s
    for e, rows in sorted(misses.items(), key=lambda kv: (-kv[1], kv[0])):
        ready = 0.0
        if needs_read(e):
            disk += read_s
            ready = disk
        t_link = max(link, ready) + cost.copy_seconds(expert_bytes)
        t_cpu = max(cpu, ready) + cost.cpu_seconds(rows)
        if t_link <= t_cpu:
            link = t_link
            to_copy.append(e)
        else:
            cpu = t_cpu
            to_cpu.append(e)
    return to_copy, to_cpu
