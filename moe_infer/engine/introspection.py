"""Reads of a running engine that a server (or a test) asks for between two steps, by name.

`UTILITIES[name](engine)` runs on the engine's own loop (thread or process) and returns plain, picklable
values, so the same names work whether the engine runs in the server's process or in one of its own:

    "stats"  (EngineStats, expert-load rows)      the /metrics scrape
    "state"  EngineState                          leaks and idleness: requests, sequences, blocks, memory
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch


@dataclass
class EngineState:
    num_requests: int  # unfinished requests in the engine
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    rss_mb: Optional[float]  # resident memory of the engine's process (None where /proc is missing)
    gpu_allocated_mb: float  # torch's allocated CUDA memory on the engine's device (0 on CPU)
    num_cuda_graphs: int  # captured so far: decode steps, prefill / mixed steps, layers' attention parts

    @property
    def is_idle(self) -> bool:
        """Nothing in flight and every KV block free."""
        return (self.num_requests == 0 and self.num_running == 0 and self.num_waiting == 0
                and self.num_free_kv_blocks == self.num_kv_blocks)


def _rss_mb() -> Optional[float]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def engine_state(engine) -> EngineState:
    sch, runner = engine.scheduler, engine.runner
    graphs = sum(len(g.graphs) for g in (runner.graphs, runner.extend_graphs, runner.layer_graphs) if g is not None)
    gpu = torch.cuda.memory_allocated(engine.device) / 2**20 if engine.device.type == "cuda" else 0.0
    return EngineState(len(engine.requests), len(sch.running), len(sch.waiting), engine.block_manager.num_blocks,
                       engine.block_manager.num_free_blocks, _rss_mb(), gpu, graphs)


def engine_stats(engine):
    return engine.get_stats(), engine.get_expert_load()


UTILITIES: Dict[str, Callable] = {"stats": engine_stats, "state": engine_state}


def run_utility(engine, name: str):
    fn = UTILITIES.get(name)
    if fn is None:
        raise ValueError(f"unknown engine utility {name!r} (known: {sorted(UTILITIES)})")
    return fn(engine)
