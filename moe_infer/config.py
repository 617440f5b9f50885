"""Typed configuration: one dataclass per Hydra config group (conf/<group>/*.yaml).

`EngineConfig` is what `LLM(...)` and `moe_infer.launch` build; every field has a default so the
Python API needs no YAML. Validation lives in `__post_init__` so a wrong value fails at once with
a message naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class ModelConfig:
    path: Optional[str] = None  # None: the embedded default checkpoint shipped in the repo
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32 (auto: float32 on CPU, bfloat16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: Optional[int] = None  # default: the checkpoint's max_position_embeddings
    enforce_eager: bool = False  # True: never replay decode steps as CUDA graphs (as vLLM's flag)
    cuda_graph_max_batch: int = 256  # the largest decode batch captured; larger batches run eagerly
    attention_backend: str = "auto"  # auto | torch (float32 reference) | sdpa | triton (paged, K/V read in place)

    def __post_init__(self) -> None:
        if self.path is not None and not str(self.path).strip():
            raise ValueError("model.path is empty: model=hf needs model.path=/path/to/checkpoint "
                             "(leave model.path unset, model=tiny_moe, for the small model shipped in the repo)")
        if self.cuda_graph_max_batch <= 0:
            raise ValueError(f"model.cuda_graph_max_batch must be positive, got {self.cuda_graph_max_batch}")
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"model.dtype must be one of {DTYPES + ('auto',)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"model.max_model_len must be positive, got {self.max_model_len}")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # None: sized from free memory (CUDA) or max_model_len (CPU)
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"cache.block_size must be positive, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"cache.num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("cache.gpu_memory_utilization must be in (0, 1]")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"scheduler.max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("scheduler.max_num_batched_tokens must be positive")


@dataclass
class RoutingConfig:
    backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    policy: str = "dropless"  # dropless | drop | reroute
    capacity_factor: float = 1.0  # used by drop / reroute
    min_capacity: int = 4
    drop_by: str = "position"  # position (DeepSpeed) | score
    collect_stats: bool = True

    def __post_init__(self) -> None:
        if self.capacity_factor <= 0:
            raise ValueError(f"routing.capacity_factor must be positive, got {self.capacity_factor}")
        if self.drop_by not in ("position", "score"):
            raise ValueError(f"routing.drop_by must be 'position' or 'score', got {self.drop_by!r}")


@dataclass
class ExpertsConfig:
    backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton


@dataclass
class OffloadConfig:
    store: str = "resident"  # where expert weights live; "resident": all on the compute device


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dispatcher: str = "exact"  # all-to-all backend when ep > 1: exact | capacity
    overlap: bool = True
    # micro-batches only when a rank's dispatch payload (T*K*D elements) reaches this many MB: on 2
    # H200s (CUDA graphs, capacity backend) overlap gained 5-7% from 134 MB (Qwen3 / DeepSeek-V3 at 4096
    # tokens) and lost at 59 MB and below (benchmarks/results/expert_parallel_2xh200_ep2.json); 0 = always
    overlap_min_mb: float = 128.0
    overlap_micro_batches: int = 2  # micro-batches (expert-slot groups) of an overlapped layer, >= 2
    placement_file: Optional[str] = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) <= 0:
                raise ValueError(f"parallel.{name} must be positive, got {getattr(self, name)}")
        if self.dispatcher not in ("exact", "capacity"):
            raise ValueError(f"parallel.dispatcher must be 'exact' or 'capacity', got {self.dispatcher!r}")
        if self.overlap_micro_batches < 2:
            raise ValueError(f"parallel.overlap_micro_batches must be >= 2, got {self.overlap_micro_batches}")
        if self.overlap_min_mb < 0:
            raise ValueError(f"parallel.overlap_min_mb must be >= 0, got {self.overlap_min_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"parallel.timeout_s must be positive, got {self.timeout_s}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0
