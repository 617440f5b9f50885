"""Typed config of the lab's experiment tasks: the `lab` node of the job config (`task=...` picks one).

Every field is validated in `__post_init__`, naming it. Trace inputs (`lab.traces`) are names:
`example` (the shipped tiny-model trace), `synthetic:<pattern>` (generated from `lab.synthetic`
with that pattern), a `.safetensors` trace path, or `stats:<path>` (a JSON list of per-layer
expert-load rows as `LLM.get_expert_load()` returns; planning only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from moe_infer.lab.synthetic import SyntheticSpec

TASK_NAMES = ("generate", "record_trace", "synthetic_trace", "cf_sweep", "eplb", "simulate", "report")


@dataclass
class DataConfig:
    source: str = "stdlib_val"  # stdlib_val (the tiny model's held-out split) | path
    path: Optional[str] = None  # source=path: a text file or a folder of .py/.txt/.md files
    seq_len: int = 512
    num_windows: int = 16
    windows_per_forward: int = 4  # windows per forward: the capacity policy counts over their tokens

    def __post_init__(self) -> None:
        if self.source not in ("stdlib_val", "path"):
            raise ValueError(f"lab.data.source must be stdlib_val or path, got {self.source!r}")
        if self.source == "path" and not self.path:
            raise ValueError("lab.data.source=path needs lab.data.path")
        for name in ("seq_len", "num_windows", "windows_per_forward"):
            if getattr(self, name) <= 0:
                raise ValueError(f"lab.data.{name} must be positive, got {getattr(self, name)}")


@dataclass
class RecordConfig:
    max_tokens: int = 1  # new tokens per held-out window (1: the trace is the windows' prefill)
    logits: bool = False  # also record the router logits
    out: str = "trace.safetensors"  # file name inside the output folder

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"lab.record.max_tokens must be positive, got {self.max_tokens}")


@dataclass
class SweepConfig:
    save_trace: bool = False  # keep the policy run's routing trace (with logits) in the job folder


@dataclass
class EplbConfig:
    num_gpus: List[int] = field(default_factory=lambda: [8, 32, 64, 256])
    gpus_per_node: int = 8
    hierarchical: bool = True  # also plan nodes-then-GPUs; kept where it balances as well as the global plan
    max_memory_overhead: float = 1.0  # replica counts tried: multiples of N up to this share of E ...
    max_replica_counts: int = 6  # ... and at most this many of them (the smallest)
    target_imbalance: float = 0.10
    target_memory: float = 0.10
    plan_fraction: float = 0.5  # plan on this first share of a trace's tokens, evaluate on the rest
    write_placements: bool = True
    expert_bytes: Optional[int] = None  # one expert's weights (3 x hidden x intermediate x dtype bytes): the
    # replicas' memory is also reported in bytes per GPU (all layers) at this size

    def __post_init__(self) -> None:
        if not self.num_gpus or min(self.num_gpus) <= 0 or self.gpus_per_node <= 0:
            raise ValueError("lab.eplb.num_gpus must list positive GPU counts; gpus_per_node must be positive")
        if not 0 < self.plan_fraction < 1:
            raise ValueError(f"lab.eplb.plan_fraction must be in (0, 1), got {self.plan_fraction}")
        if self.max_memory_overhead < 0:
            raise ValueError("lab.eplb.max_memory_overhead must be >= 0")


@dataclass
class SimulateConfig:
    shape: str = "deepseek-v3"  # the calibrated expert shape whose costs the trace's routing is priced at
    device: str = "H200"
    results_dir: Optional[str] = None  # calibration JSONs (default: the checkout's benchmarks/results)
    num_gpus: List[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256, 512, 1024])
    gpus_per_node: int = 8
    tokens_per_gpu: int = 256
    num_steps: int = 4
    capacity_factors: List[float] = field(default_factory=lambda: [1.0, 1.25])
    replicas_per_gpu: List[int] = field(default_factory=lambda: [0, 1, 2])  # EPLB with k*N replicas
    online_replicas_per_gpu: List[int] = field(default_factory=lambda: [1])  # EPLB re-planned while replaying
    replan_every: int = 2  # steps between the online re-plans (on the load of the steps since the last)
    hierarchical: bool = True  # also plan nodes-then-GPUs; kept where it balances as well as the global plan
    plan_fraction: float = 0.5
    network_gbps: float = 400.0
    network_alpha_us: float = 20.0

    def __post_init__(self) -> None:
        if not self.num_gpus or min(self.num_gpus) <= 0:
            raise ValueError("lab.simulate.num_gpus must list positive GPU counts")
        for name in ("tokens_per_gpu", "num_steps", "gpus_per_node", "replan_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"lab.simulate.{name} must be positive, got {getattr(self, name)}")
        if (any(c <= 0 for c in self.capacity_factors)
                or any(k < 0 for k in self.replicas_per_gpu + self.online_replicas_per_gpu)):
            raise ValueError("lab.simulate.capacity_factors must be positive and replicas_per_gpu >= 0")
        if not 0 < self.plan_fraction < 1:
            raise ValueError(f"lab.simulate.plan_fraction must be in (0, 1), got {self.plan_fraction}")


@dataclass
class LabConfig:
    out_dir: Optional[str] = None  # default: the Hydra job's output folder
    traces: List[str] = field(default_factory=lambda: ["example"])
    synthetic: SyntheticSpec = field(default_factory=SyntheticSpec)
    data: DataConfig = field(default_factory=DataConfig)
    record: RecordConfig = field(default_factory=RecordConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    report_dirs: List[str] = field(default_factory=list)  # task=report: result folders to gather

    def __post_init__(self) -> None:
        for name in self.traces:
            if not (name == "example" or name.startswith(("synthetic:", "stats:")) or name.endswith(".safetensors")):
                raise ValueError(f"lab.traces entry {name!r}: use example, synthetic:<pattern>, stats:<file.json> "
                                 f"or a .safetensors trace path")
