"""Typed configuration: one dataclass per Hydra config group (conf/<group>/*.yaml).

`EngineConfig` is what `LLM(...)` and `moe_infer.launch` build; every field has a default so the
Python API needs no YAML. Validation lives in `__post_init__` so a wrong value fails at once with
a message naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

DTYPES = ("bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("fp8", "int4")  # online quantization of a bf16 checkpoint (vLLM's `quantization=` names)


@dataclass
class ModelConfig:
    path: Optional[str] = None  # None: the embedded default checkpoint shipped in the repo
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32 (auto: float32 on CPU, bfloat16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: Optional[int] = None  # default: the checkpoint's max_position_embeddings
    load_format: str = "auto"  # auto: the checkpoint's safetensors | dummy: random weights, config.json only
    # None: the checkpoint's own format | fp8 | int4: a bf16 checkpoint quantized at load (models/online_quant.py)
    quantization: Optional[str] = None
    enforce_eager: bool = False  # True: never replay decode steps as CUDA graphs (as vLLM's flag)
    cuda_graph_max_batch: int = 256  # the largest decode batch captured; larger batches run eagerly
    # the most tokens of a prefill / mixed step replayed as a CUDA graph (0: those steps run eagerly)
    cuda_graph_max_tokens: int = 2048
    attention_backend: str = "auto"  # auto | torch (float32 reference) | sdpa | triton (paged, K/V read in place)
    # in a step with prompt tokens, the last layer computes past its K/V write only each sequence's last row (the
    # one the model's output is read at; moe_infer/layers/last_rows.py); off with a capacity policy or the trace
    prune_last_layer: bool = True
    # worker processes that compile the start-up warm-up's Triton kernels in parallel (moe_infer/kernels/precompile.py;
    # CUDA only): 0 (default): compiled one after the other, in the engine's process; None: one per CPU core but one
    # (at most 32). Off by default: not yet measured on a GPU, and a worker per core for every engine swamps a machine
    # that starts several engines at once
    compile_workers: Optional[int] = 0

    def __post_init__(self) -> None:
        if self.path is not None and not str(self.path).strip():
            raise ValueError("model.path is empty: model=hf needs model.path=/path/to/checkpoint "
                             "(leave model.path unset, model=tiny_moe, for the small model shipped in the repo)")
        if self.compile_workers is not None and self.compile_workers < 0:
            raise ValueError(f"model.compile_workers must be >= 0 (0: no worker processes), got {self.compile_workers}")
        if self.cuda_graph_max_batch <= 0:
            raise ValueError(f"model.cuda_graph_max_batch must be positive, got {self.cuda_graph_max_batch}")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError(f"model.cuda_graph_max_tokens must be >= 0 (0: no graphs of prefill steps), got "
                             f"{self.cuda_graph_max_tokens}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"model.load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"model.quantization must be one of {QUANTIZATIONS} or null (the checkpoint's own "
                             f"format), got {self.quantization!r}")
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
    # auto: the model dtype | fp8 / fp8_e4m3 (vLLM's names): e4m3 K/V with per-head scales 1.0, twice the tokens
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"cache.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
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
    # schedule and launch step n+1 while the device runs step n (vLLM's async scheduling); the engine falls
    # back to synchronous steps where it cannot (moe_infer/engine/async_scheduling.py)
    async_scheduling: bool = True

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
    trace: bool = False  # record every token's chosen experts and weights (LLM.save_routing_trace)
    trace_logits: bool = False  # ... and the router logits (E values a token per layer)
    trace_max_tokens: int = 1_000_000  # recording stops after this many token rows

    def __post_init__(self) -> None:
        if self.trace_max_tokens <= 0:
            raise ValueError(f"routing.trace_max_tokens must be positive, got {self.trace_max_tokens}")
        if self.trace_logits and not self.trace:
            raise ValueError("routing.trace_logits=true needs routing.trace=true")
        if self.capacity_factor <= 0:
            raise ValueError(f"routing.capacity_factor must be positive, got {self.capacity_factor}")
        if self.drop_by not in ("position", "score"):
            raise ValueError(f"routing.drop_by must be 'position' or 'score', got {self.drop_by!r}")


@dataclass
class ExpertsConfig:
    backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton


@dataclass
class OffloadConfig:
    """Where expert weights live (docs/offload.md). resident: all on the compute device; cpu: all in
    pinned host memory, a GPU cache of slots per layer; nvme: in files under nvme_path, a pinned
    host cache of cpu_budget_gb in front of them, the GPU cache in front of that."""

    store: str = "resident"  # moe_infer.offload.EXPERT_STORES: resident | cpu | nvme
    gpu_expert_budget_gb: Optional[float] = None  # GiB of GPU memory for experts (cache + stream buffers)
    slots_per_layer: Optional[int] = None  # instead of the budget: cache slots per MoE layer
    cache_policy: str = "lru"  # moe_infer.offload.policies.CACHE_POLICIES: lru | lfu (frequency-aware)
    prefetch: bool = True  # pre-gate the next layer's experts with its router on the current hidden state
    prefetch_stats_weight: float = 0.0  # blend of the recorded expert frequencies into the prediction, [0, 1]
    max_prefetch: Optional[int] = None  # experts prefetched per layer at most (None: top_k x tokens, <= slots)
    prefetch_rule: str = "saving"  # moe_infer.offload.prefetch.PREFETCH_RULES: saving (expected saving > 0) | all
    prefetch_min_prob: float = 0.3  # saving: no prefetch of an expert less likely than this to be needed, [0, 1]
    miss_policy: str = "auto"  # auto (the cost model picks copy or CPU) | share (both, split along F) | wait | cpu
    stream_fraction: float = 0.75  # a step that needs more than this share of a layer's experts streams them
    stream_chunk: Optional[int] = None  # experts per double buffer (None: max(1, top_k // 2))
    cpu_budget_gb: Optional[float] = None  # nvme: GiB of pinned host cache (None: one layer's experts x 4)
    nvme_path: Optional[str] = None  # nvme: a directory on a local disk with room for every expert
    nvme_reader: str = "auto"  # auto (DeepSpeed async I/O, else threads) | deepspeed | threads
    pin_memory: bool = True  # CUDA: page-lock the host tier (the link runs ~3x faster than from pageable)
    expert_graphs: bool = True  # CUDA: a layer step's device experts replayed as CUDA graphs (off under enforce_eager)

    def __post_init__(self) -> None:
        if self.gpu_expert_budget_gb is not None and self.gpu_expert_budget_gb <= 0:
            raise ValueError(f"offload.gpu_expert_budget_gb must be positive, got {self.gpu_expert_budget_gb}")
        if self.slots_per_layer is not None and self.slots_per_layer < 0:
            raise ValueError(f"offload.slots_per_layer must be >= 0, got {self.slots_per_layer}")
        if self.gpu_expert_budget_gb is not None and self.slots_per_layer is not None:
            raise ValueError("give offload.gpu_expert_budget_gb or offload.slots_per_layer, not both")
        if not 0.0 <= self.prefetch_stats_weight <= 1.0:
            raise ValueError(f"offload.prefetch_stats_weight must be in [0, 1], got {self.prefetch_stats_weight}")
        if not 0.0 <= self.prefetch_min_prob <= 1.0:
            raise ValueError(f"offload.prefetch_min_prob must be in [0, 1], got {self.prefetch_min_prob}")
        if self.max_prefetch is not None and self.max_prefetch < 0:
            raise ValueError(f"offload.max_prefetch must be >= 0, got {self.max_prefetch}")
        if self.miss_policy not in ("auto", "share", "wait", "cpu"):
            raise ValueError(f"offload.miss_policy must be auto, share, wait or cpu, got {self.miss_policy!r}")
        if not 0.0 < self.stream_fraction <= 1.0:
            raise ValueError(f"offload.stream_fraction must be in (0, 1], got {self.stream_fraction}")
        if self.stream_chunk is not None and self.stream_chunk <= 0:
            raise ValueError(f"offload.stream_chunk must be positive, got {self.stream_chunk}")
        if self.cpu_budget_gb is not None and self.cpu_budget_gb <= 0:
            raise ValueError(f"offload.cpu_budget_gb must be positive, got {self.cpu_budget_gb}")
        if self.nvme_reader not in ("auto", "deepspeed", "threads"):
            raise ValueError(f"offload.nvme_reader must be auto, deepspeed or threads, got {self.nvme_reader!r}")
        if self.store == "nvme" and not self.nvme_path:
            raise ValueError("offload.store=nvme needs offload.nvme_path (a directory on a local disk)")


DISPATCHER_NAMES = ("auto", "reduce", "exact", "capacity")


@dataclass
class ParallelConfig:
    """The mesh (docs/scaling.md): torchrun starts pp * lcm(tp, ep) processes."""

    tp: int = 1  # attention heads, dense / shared-expert intermediate and vocabulary split over tp ranks
    pp: int = 1  # pipeline stages (layers split over them)
    ep: int = 1  # routed experts split over ep ranks of a stage (ep = 1, tp > 1: each expert's F split)
    pp_layer_partition: Optional[List[int]] = None  # decoder layers per stage; None: as even as possible
    # how tokens reach the experts when ep > 1: auto | reduce | exact | capacity. auto: reduce where every EP rank
    # holds the same tokens (the engine: no tokens move, one all-reduce a layer, CUDA-graph safe) and the experts
    # are resident; exact otherwise (docs/expert_parallel.md)
    dispatcher: str = "auto"
    overlap: bool = True
    # micro-batches only when a rank's dispatch payload (T*K*D elements; the reduce dispatcher: its all-reduce, T*D)
    # reaches this many MB. For the all-to-all dispatchers: on 2
    # H200s (CUDA graphs, capacity backend) overlap gained 5-7% from 134 MB (Qwen3 / DeepSeek-V3 at 4096
    # tokens) and lost at 59 MB and below (benchmarks/results/expert_parallel_2xh200_ep2.json); 0 = always
    overlap_min_mb: float = 128.0
    overlap_micro_batches: int = 2  # micro-batches of an overlapped layer (expert-slot groups; reduce: token chunks), >= 2
    placement_file: Optional[str] = None
    num_redundant_experts: int = 0  # without a placement file: replica slots (a multiple of ep) to start from
    enable_eplb: bool = False  # online re-balancing: re-plan the placement from live load statistics ...
    eplb_step_interval: int = 1000  # ... every this many steps, and move the expert weights between ranks
    # every collective and transfer of a step: a rank that hangs longer is named in the error (gloo; NCCL:
    # torch's watchdog aborts, see docs/scaling.md). Long enough for a cold Triton compile inside a step.
    timeout_s: float = 120.0
    # tp = pp = ep = 1 through the mesh's code path anyway (process groups of one rank, the step sent over them):
    # what benchmarks/mesh_scaling.py measures the mesh's own cost with; under torchrun or in a plain process
    force_mesh: bool = False
    # attention data parallelism (SGLang's DP attention): where ep > tp a stage holds dp = lcm(tp, ep) / tp attention
    # replicas; on, each replica runs its own requests with its own KV cache, the MoE layers see every replica's
    # tokens (docs/expert_parallel.md). Needs dp > 1
    dp_attention: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) <= 0:
                raise ValueError(f"parallel.{name} must be positive, got {getattr(self, name)}")
        if self.dispatcher not in DISPATCHER_NAMES:
            raise ValueError(f"parallel.dispatcher must be one of {', '.join(DISPATCHER_NAMES)}, got {self.dispatcher!r}")
        if self.overlap_micro_batches < 2:
            raise ValueError(f"parallel.overlap_micro_batches must be >= 2, got {self.overlap_micro_batches}")
        if self.overlap_min_mb < 0:
            raise ValueError(f"parallel.overlap_min_mb must be >= 0, got {self.overlap_min_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"parallel.timeout_s must be positive, got {self.timeout_s}")
        if self.pp_layer_partition is not None and (len(self.pp_layer_partition) != self.pp
                                                    or any(n < 1 for n in self.pp_layer_partition)):
            raise ValueError(f"parallel.pp_layer_partition must list pp={self.pp} positive layer counts, "
                             f"got {list(self.pp_layer_partition)}")
        if self.num_redundant_experts < 0 or self.num_redundant_experts % self.ep:
            raise ValueError(f"parallel.num_redundant_experts={self.num_redundant_experts} must be a non-negative "
                             f"multiple of parallel.ep={self.ep} (every rank holds the same number of slots)")
        if self.eplb_step_interval <= 0:
            raise ValueError(f"parallel.eplb_step_interval must be positive, got {self.eplb_step_interval}")


SPECULATIVE_METHODS = ("ngram", "draft", "mtp")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (docs/speculative.md): a proposer guesses up to num_speculative_tokens tokens per
    sequence, one step of the model verifies them. vLLM's names where it has them. method None: off."""

    method: Optional[str] = None  # None (off) | ngram (prompt lookup, no model) | draft (a small model) | mtp
    num_speculative_tokens: int = 3  # k: the most tokens proposed per sequence and step
    prompt_lookup_min: int = 1  # ngram: the shortest suffix of the sequence looked up in its earlier tokens
    prompt_lookup_max: int = 4  # ngram: the longest
    draft_model: Optional[str] = None  # draft: the draft checkpoint folder (same vocabulary as the target)
    draft_load_format: str = "auto"  # draft: auto (its safetensors) | dummy (random weights: benchmarks)
    # no speculation while this many sequences or more decode in a step (decoding is compute-bound there);
    # None: never disabled by the batch size
    disable_by_batch_size: Optional[int] = 32
    adaptive: bool = True  # pick k per step from the measured acceptance rate and the batch size (<= k)

    def __post_init__(self) -> None:
        if self.method is None:
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)} (or null: off), "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative.num_speculative_tokens must be an int >= 1, got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min / prompt_lookup_max must satisfy 1 <= min <= max, got "
                             f"{self.prompt_lookup_min} / {self.prompt_lookup_max}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.method=draft needs speculative.draft_model (a checkpoint folder)")
        if self.draft_load_format not in ("auto", "dummy"):
            raise ValueError(f"speculative.draft_load_format must be 'auto' or 'dummy', got {self.draft_load_format!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative.disable_by_batch_size must be >= 1 or null, got "
                             f"{self.disable_by_batch_size}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    seed: int = 0
