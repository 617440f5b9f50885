"""The model runner: loads the model, owns the KV cache, turns a step's plan into tensors, runs, samples.

It never decides policy: the plan (`SchedulerOutput`) says which tokens of which sequences run and
which sequences sample. The step's tensors are built once, on the host then copied: input ids,
positions, slot mapping, block tables, query_start_loc, seq lens (`step_inputs.py`). Logits are
computed only for the last token of each sequence that samples (a decode, or the chunk that ends a
prompt).

On one rank `execute(plan)` is the whole step: `launch` (inputs, forward, LM head, sampling: device
work queued, no host sync) then `collect` (waits for the sampled tokens). Async scheduling launches
step n+1 before collecting step n; a sequence whose input is the token step n samples gets it on the
device from step n's sampled ids (`launch(plan, prev)`). Under a mesh the runner holds this rank's part of the
model (`ModelShard`: its stage's layers, its heads and shards) and KV cache (its layers' KV heads,
under the driver's block ids), and the step pipeline (`moe_infer.parallel.pipeline`) calls its
pieces: `paths` (load on the driver, receive elsewhere: moe_infer/engine/step_paths.py), `before_forward`,
`forward_step` (the same CUDA graphs on every rank, their collectives inside) and `sample` (the sampling rank).
Which CUDA graphs a runner gets, and their set-up, is moe_infer/engine/runner_graphs.py.

Legend: T tokens of the step, B sequences of the step, S sequences that sample, M max blocks per
sequence, V vocabulary, D hidden.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import numpy as np
import torch

from moe_infer.config import EngineConfig
from moe_infer.engine.backends import offload_manager, resolve_moe_backends
from moe_infer.engine.runner_graphs import extend_graph_tokens, set_up_graphs
from moe_infer.engine.sampler import SampledTokens, SampleRequest, Sampler
from moe_infer.engine.startup_timings import StartupTimings
from moe_infer.engine.sequence import SchedulerOutput
from moe_infer.engine.step_inputs import (
    LaunchedStep, Sizes, StepDecoder, StepEncoder, StepInputs, flat_inputs, message_layout, per_plan_entry,
    placeholder_rows, plan_requests,
)
from moe_infer.engine.step_paths import StepPaths, fill_placeholders
from moe_infer.engine.warmup import warm_up_runner
from moe_infer.layers.forward_context import forward_context
from moe_infer.parallel.engine_hooks import expert_dispatcher, init_engine_parallel
from moe_infer.parallel.step_message import FLAG_RESET_STATS
from moe_infer.routing.stats import ExpertLoadStats
from moe_infer.routing.trace_recorder import RoutingTraceRecorder

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 4 << 30  # the most a CPU KV cache takes when num_kv_blocks is not given


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_path: str, device: torch.device, dtype: torch.dtype,
                 parallel=None, kv_reserve: Tuple[int, int] = (0, 0)) -> None:
        """kv_reserve: (bytes per KV block, bytes) the KV budget leaves for what is loaded after this runner: a
        speculative draft model's own cache under the same block ids, and its weights."""
        from moe_infer.models import load_model
        from moe_infer.models.hf_config import import_transformers_config, load_arch

        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.kv_reserve = kv_reserve
        self.block_size = cfg.cache.block_size
        # where start-up goes, in parts (moe_infer/engine/startup_timings.py; benchmarks/startup.py reads them)
        self.startup_timings = timings = StartupTimings()
        with timings.part("plugins_s"):
            self.backends = resolve_moe_backends(cfg, device)
        self.parallel = parallel if parallel is not None else init_engine_parallel(cfg, model_path)
        with timings.part("transformers_import_s"):
            import_transformers_config()
        with timings.part("hf_config_s"):
            self.backends.dispatcher = expert_dispatcher(self.parallel, cfg, model_path)  # None: all experts here
            self.offload = self.backends.offload = offload_manager(cfg, model_path, device, dtype, self.backends)
            shard = self.parallel.model_shard(load_arch(model_path)[0].num_layers)
        self.dp = shard.dp  # attention data parallelism: this stage's replicas, each with its own requests
        self.dp_paths = None
        with timings.part("model_load_s"):
            self.model = load_model(model_path, dtype, device, self.backends, cfg.model.attention_backend,
                                    load_format=cfg.model.load_format, shard=shard,
                                    quantization=cfg.model.quantization, mtp=cfg.speculative.method == "mtp")
            if self.offload is not None:  # NVMe files synced, the cost model measured; KV is sized after the cache
                self.offload.finish_load()
        arch = self.model.arch
        self.arch = arch
        self._extend_tokens: Optional[int] = None  # runner_graphs.extend_graph_tokens, decided once
        self.stats: Optional[ExpertLoadStats] = None
        if cfg.routing.collect_stats:
            self.stats = ExpertLoadStats(arch.num_layers, arch.num_experts, device)
            self.backends.stats = self.stats  # the MoE layers share this MoEBackends object
        self.trace: Optional[RoutingTraceRecorder] = None
        if cfg.routing.trace and self.parallel.dims.pp > 1:
            raise ValueError("routing.trace=true with pipeline stages (parallel.pp > 1) is not supported yet: the "
                             "driver records its own stage's MoE layers only")
        if cfg.routing.trace and self.parallel.is_driver:  # every EP rank routes the same tokens
            self.trace = RoutingTraceRecorder(arch.moe_layer_ids, arch.num_experts, arch.top_k, device,
                                              cfg.routing.trace_logits, cfg.routing.trace_max_tokens)
            self.backends.trace = self.trace
        self.max_model_len = min(cfg.model.max_model_len or arch.max_position_embeddings,
                                 arch.max_position_embeddings)
        if cfg.model.max_model_len and cfg.model.max_model_len > arch.max_position_embeddings:
            raise ValueError(f"model.max_model_len={cfg.model.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings={arch.max_position_embeddings}")
        if cfg.cache.kv_cache_dtype != "auto":
            self._use_fp8_kv_cache()
        with timings.part("kv_cache_s"):
            self.num_kv_blocks = self.parallel.agree_min(self._num_kv_blocks())  # the same block ids on every rank
            self.kv_caches = self._allocate_kv_cache(self.num_kv_blocks)
            self.model.bind_kv_cache(self.kv_caches)
        self.last_rows = self._last_rows_on()
        self.sampler = Sampler(arch.vocab_size, arch.eos_token_ids, device, seed=cfg.seed)
        self.verifier = None  # speculative decoding: the verification of proposed tokens (engine/speculative/)
        # the MTP proposer reads each step's hidden states: (plan, hidden_TD) of the last step launched
        self.keep_hidden, self.last_hidden = cfg.speculative.method == "mtp", None
        if cfg.speculative.enabled:
            from moe_infer.engine.speculative.verify import Verifier

            self.verifier = Verifier(self.sampler)
        self.encoder, self.decoder = StepEncoder(self.block_size), StepDecoder()  # the mesh's step messages
        with timings.part("kernel_warmup_s"):
            self.warmup_s = warm_up_runner(self)  # every Triton kernel variant a step can select, compiled now
        with timings.part("cuda_graphs_s"):  # the graphs' buffers and warm-up forwards (captured at first use)
            set_up_graphs(self)  # graphs, layer_graphs, extend_graphs (moe_infer/engine/runner_graphs.py)
        self.paths = StepPaths(self, device, self.block_size)
        if self.dp.communicates:  # attention data parallelism: dp segments a step (moe_infer/engine/dp_inputs.py)
            from moe_infer.engine.dp_inputs import DPPaths, fill_placeholders_dp

            self.paths = self.dp_paths = DPPaths(self.paths, self.dp.size, self.parallel.replica,
                                                 cfg.scheduler.max_num_seqs)
            self.fill_placeholders = fill_placeholders_dp
        self.rebalancer = None
        if cfg.parallel.enable_eplb:  # online expert re-balancing (moe_infer/parallel/rebalance.py)
            if self.parallel.dims.ep == 1:
                raise ValueError("parallel.enable_eplb=true needs expert parallelism (parallel.ep > 1)")
            if self.parallel.dims.pp > 1:  # the driver plans from its own statistics: one stage's layers
                raise ValueError("parallel.enable_eplb=true with pipeline stages (parallel.pp > 1) is not "
                                 "supported yet")
            from moe_infer.parallel.rebalance import OnlineRebalancer

            self.rebalancer = OnlineRebalancer(self.parallel, self.model.moe_layers(), self.stats,
                                               cfg.parallel.eplb_step_interval)

    def _last_rows_on(self) -> bool:
        """model.prune_last_layer where the rows of a layer are independent and no recorder wants every row: the
        dropless policy (a capacity drops rows by what the others chose), no routing trace; and where this model
        part can run it (moe_infer/layers/last_rows.py)."""
        cfg = self.cfg
        return (cfg.model.prune_last_layer and cfg.routing.policy == "dropless" and not cfg.routing.trace
                and not cfg.speculative.enabled  # a verify step samples at every proposed token's row
                and self.model.can_run_last_rows())

    # ------------------------------------------------------------------ KV cache
    def _num_kv_blocks(self) -> int:
        bytes_per_block = self.model.kv_cache_bytes_per_block(self.block_size) + self.kv_reserve[0]
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        useful = blocks_per_seq * self.cfg.scheduler.max_num_seqs  # more can never be used at once
        if self.cfg.cache.num_kv_blocks is not None:
            return self.cfg.cache.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = (free - total * (1.0 - self.cfg.cache.gpu_memory_utilization) - self._activation_bytes()
                      - self.kv_reserve[1])
            num = min(int(budget // bytes_per_block), useful)
            if num < blocks_per_seq:
                raise RuntimeError(
                    f"only {max(num, 0)} KV blocks fit in GPU memory (free {free / 2**30:.1f} GiB, "
                    f"gpu_memory_utilization={self.cfg.cache.gpu_memory_utilization}); one sequence of "
                    f"max_model_len={self.max_model_len} needs {blocks_per_seq}: lower max_model_len")
            return num
        return max(1, min(useful, CPU_KV_CACHE_BYTES // bytes_per_block))

    def _activation_bytes(self) -> int:
        """A generous bound on one step's activations (MoE rows dominate), kept out of the KV budget; with
        prefill steps as CUDA graphs, their graph pool holds a second step's worth (up to their token limit)."""
        T = self.cfg.scheduler.max_num_batched_tokens + extend_graph_tokens(self)
        T *= self.parallel.dims.num_replicas  # attention data parallelism: the MoE layers run every replica's rows
        hf = self.model.hf_config
        D = getattr(hf, "hidden_size", 4096)
        F = max(getattr(hf, "moe_intermediate_size", 0) or 0, getattr(hf, "intermediate_size", 0) or 0)
        elem = torch.finfo(self.dtype).bits // 8
        mla, up_projected = self.arch.mla, 0
        if mla is not None:  # an up-projected prompt step's per-head K and V (moe_infer/layers/mla.py), at most
            from moe_infer.layers.mla import UP_PROJECT_SHARE

            heads = self.model.layers[self.model.local_layers[0]].self_attn.num_heads
            up_projected = UP_PROJECT_SHARE * T * heads * mla.qk_head_dim * 2 * elem
        return up_projected + int(T * (16 * D + 6 * self.arch.top_k * F) * elem + self.cfg.scheduler.max_num_seqs
                   * self.arch.vocab_size * (4 * 4 + elem)) + (512 << 20)  # + the decode graphs' logits buffer

    def _use_fp8_kv_cache(self) -> None:
        """cache.kv_cache_dtype fp8 / fp8_e4m3: e4m3 K/V caches (the attention kernels read them in the model dtype,
        which needs fp8 conversions: compute capability 8.9+ on CUDA)."""
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(f"cache.kv_cache_dtype={self.cfg.cache.kv_cache_dtype}: the fp8 KV cache needs a GPU of "
                             f"compute capability 8.9+ (Ada, Hopper), this one is "
                             f"{torch.cuda.get_device_capability(self.device)}: use cache.kv_cache_dtype=auto")
        self.model.set_kv_cache_dtype(torch.float8_e4m3fn)
        logger.info("KV cache in fp8 (e4m3, scales 1.0): %d bytes a token against %d in %s, twice the tokens "
                    "in the same memory", self.model.kv_cache_bytes_per_block(self.block_size) // self.block_size,
                    self.model.kv_cache_bytes_per_block(self.block_size) // self.block_size
                    * self.dtype.itemsize, self.dtype)

    def _allocate_kv_cache(self, num_blocks: int) -> List[Tuple[torch.Tensor, ...]]:
        """The cache tensors of each layer of this rank's stage: a (K, V) pair for its KV heads, or MLA's latent
        rows; logs what a token costs."""
        caches = self.model.allocate_kv_cache(num_blocks, self.block_size, self.device)
        per_token = self.model.kv_cache_bytes_per_block(self.block_size) // self.block_size
        mla, what = self.arch.mla, "per-head K/V"
        if mla is not None:  # what the same heads' K/V would take, per layer and token
            mha = self.model.layers[self.model.local_layers[0]].self_attn.num_heads * (mla.qk_head_dim + mla.v_head_dim)
            what = (f"MLA latent rows of {mla.cache_dim} values a layer; per-head K/V of the same heads would take "
                    f"{mha} ({mha / mla.cache_dim:.0f}x)")
        logger.info("KV cache: %d blocks of %d tokens, %d bytes a token on this rank (%s)", num_blocks,
                    self.block_size, per_token, what)
        if self.dp.communicates:
            logger.info("attention data parallelism: %d replicas a stage, each with a KV cache of its own for its own "
                        "requests: the stage holds %d blocks (%d tokens)", self.dp.size, self.dp.size * num_blocks,
                        self.dp.size * num_blocks * self.block_size)
        return caches

    # ------------------------------------------------------------------ the step (one rank)
    def prepare(self, plan: SchedulerOutput, prev: Optional[LaunchedStep] = None) -> StepInputs:
        """input_ids_T, the attention metadata and the row of each sampling sequence's last token: one
        host buffer, copied to the device once and sliced there (a step for a graph: laid out as its graphs read
        it, moe_infer/engine/step_paths.py). Rows whose input is the token the step in flight (prev) samples take
        it from prev's sampled ids, on the device."""
        flat, sizes, num_extra = self.lay_out(plan, prev)
        inputs, extra_X, _ = self.paths.load(self.paths.choose(sizes), flat, sizes, num_extra)
        if num_extra:
            fill_placeholders(inputs, extra_X, prev.sampled.token_ids_B)
        return inputs

    def lay_out(self, plan: SchedulerOutput, prev: Optional[LaunchedStep] = None) -> Tuple[np.ndarray, Sizes, int]:
        """(`flat_inputs`' host buffer, its sizes, the number of extra entries at its end): the step's integer inputs
        and, for rows whose input prev samples, their rows and that token's index in prev's sample."""
        if self.dp.communicates:  # one segment per attention replica, padded alike (moe_infer/engine/dp_inputs.py)
            from moe_infer.engine.dp_inputs import dp_lay_out

            step = dp_lay_out(plan.parts, self.block_size, prev)
            return step, step.sizes, step.num_extra
        rows, src = placeholder_rows(plan, prev)
        flat, sizes = flat_inputs(plan, self.block_size, rows + src)
        return flat, sizes, 2 * len(rows)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> Tuple[List[Optional[int]], List[Optional[tuple]]]:
        """Runs one step; returns per plan entry the sampled token (None: no sample) and its logprobs."""
        return self.collect(self.launch(plan))

    def collect(self, step: Optional[LaunchedStep]) -> Tuple[List[Optional[int]], List[Optional[tuple]]]:
        """Waits for a launched step's tokens: per plan entry the sampled token (None: no sample), logprobs."""
        if step is None:
            return [], []
        out = step.sampled.result() if step.sampled is not None else None
        return per_plan_entry(step.plan, out.token_ids if out else [], out.logprobs if out else [])

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput, prev: Optional[LaunchedStep] = None) -> Optional[LaunchedStep]:
        """Queues one step on the device (no host sync on the decode-graph path); None for an empty plan.
        prev: the step in flight, whose sampled ids feed this plan's `input_in_flight` rows."""
        self.sampler.forget(plan.finished_seq_ids)
        if plan.is_empty:
            return None
        inputs = self.prepare(plan, prev)
        self.before_forward(inputs)
        hidden_TD, logits_TV = self.forward_step(inputs)
        if self.keep_hidden:
            self.last_hidden = (plan, hidden_TD)
        if self.verifier is not None and any(s.spec_token_ids for s in plan.seqs):  # speculative decoding
            return LaunchedStep(plan, self.verifier.verify(self.sample_logits(inputs, hidden_TD, logits_TV), plan))
        return LaunchedStep(plan, self.sample(inputs, hidden_TD, plan_requests(plan), logits_TV))

    @torch.inference_mode()
    def forward_step(self, inputs: StepInputs, hidden_in: Optional[torch.Tensor] = None
                     ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(hidden_TD, logits_TV) of a prepared step, one of them None: its graphs replayed where it was laid out
        for them, else the eager forward. hidden_in: the previous pipeline stage's output (stages after the first;
        on a graph path it lies in the graphs' buffer already, `StepPaths.hidden_input`)."""
        hidden_TD = logits_TV = None
        if inputs.dp is not None and inputs.dp.copy_in is not None:  # no graph prologue: this replica's segment
            inputs.dp.copy_in[1].copy_(inputs.dp.copy_in[0])
        if inputs.bucket is not None:
            hidden_TD = self.extend_graphs.replay(inputs)  # None: run eagerly
        elif inputs.decode_bucket is not None:  # None: the capture failed, run eagerly
            out = self.graphs.replay(inputs)
            hidden_TD, logits_TV = (None, out) if self.graphs.with_logits else (out, None)
        elif self.layer_graphs is not None and self.layer_graphs.can_run(inputs.sizes):
            hidden_TD = self.layer_graphs.run(inputs.input_ids_T, inputs.meta)
        if hidden_TD is None and logits_TV is None:
            # attention data parallelism: rows without a KV slot are a replica's padding (dp_inputs.py)
            valid_T = inputs.meta.slot_mapping_T >= 0 if self.dp.communicates else None
            with forward_context(inputs.meta, valid_T=valid_T, last_rows=self.last_rows):
                hidden_TD = self.model(inputs.input_ids_T, inputs.meta.positions_T, hidden_in)
        return hidden_TD, logits_TV

    def before_forward(self, inputs: StepInputs, flags: int = 0) -> None:
        """Between steps, on every rank in the same order: the expert-load statistics reset when the driver's
        message says so (flags); online re-balancing moves expert weights; the routing recorder opens the step's
        rows (it blocks graph replay, so the forward is eager)."""
        if flags & FLAG_RESET_STATS and self.stats is not None:
            self.stats.reset()
        if self.rebalancer is not None:
            self.rebalancer.step()
        if self.trace is not None:
            self.trace.begin_step(inputs.meta.positions_T, inputs.input_ids_T.shape[0])

    @torch.inference_mode()
    def sample(self, inputs: StepInputs, hidden_TD: Optional[torch.Tensor], reqs: Optional[List[SampleRequest]],
               logits_TV: Optional[torch.Tensor] = None) -> Optional[SampledTokens]:
        """Logits of the sampling rows (a collective over tp; logits_TV: every row's, from a decode graph),
        sampled (launched) where reqs are given (the sampling rank's part of a mesh step)."""
        if self.dp.communicates and logits_TV is None and inputs.sizes[2] > 0:
            return self._sample_dp(inputs, self._sampling_hidden(inputs, hidden_TD), reqs)
        logits_SV = self.sample_logits(inputs, hidden_TD, logits_TV)
        if logits_SV is None or reqs is None:
            return None
        on_device = any(r.last_on_device for r in reqs)  # penalties over a token sampled by the step in flight
        return self.sampler.sample(logits_SV, reqs, inputs.input_ids_T[inputs.sample_rows_S] if on_device else None)

    def sample_logits(self, inputs: StepInputs, hidden_TD: Optional[torch.Tensor],
                      logits_TV: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The logits of the step's sampling rows [S, V] (None when none samples); not under attention data
        parallelism, whose replicas' rows are gathered and sampled together (`sample`)."""
        T, S = inputs.sizes[0], inputs.sizes[2]
        if S == 0:
            return None
        # every row samples (a decode step): the rows in order, no gather
        if logits_TV is not None:
            return logits_TV[:S] if S == T else logits_TV[inputs.sample_rows_S]
        if self.dp.communicates:
            raise RuntimeError("sample_logits under attention data parallelism: the replicas sample through sample()")
        return self.model.compute_logits(self._sampling_hidden(inputs, hidden_TD), upcast=False)  # cast by the sampler

    def _sampling_hidden(self, inputs: StepInputs, hidden_TD: torch.Tensor) -> torch.Tensor:
        """The hidden states of the step's sampling rows [S, D]."""
        T, B, S = inputs.sizes[:3]
        # (attention data parallelism: a replica's sampling rows are padded, not every row even where S == T)
        in_order = inputs.dp is None and not self.dp.communicates
        if hidden_TD.shape[0] == T:
            return hidden_TD[:S] if S == T and in_order else hidden_TD[inputs.sample_rows_S]
        # one row a sequence, its last (the last layer ran those only: moe_infer/layers/last_rows.py)
        return hidden_TD[:S] if S == B and in_order else hidden_TD.index_select(0, self._sampling_seqs(inputs))

    def _sample_dp(self, inputs: StepInputs, hidden_SD: torch.Tensor, reqs: Optional[List[SampleRequest]]
                   ) -> Optional[SampledTokens]:
        """Attention data parallelism: every replica's sampling rows gathered over dp ([dp * S, D], padded alike);
        replica 0 computes their logits, the driver samples the real ones (`DPRows.sel_S`, in plan order)."""
        hidden_ND = self.dp.all_gather_rows(hidden_SD)
        if self.parallel.replica != 0:
            return None
        logits_NV = self.model.compute_logits(hidden_ND, upcast=False)
        if reqs is None:
            return None
        rows = inputs.dp
        on_device = any(r.last_on_device for r in reqs)
        ids_S = rows.words.index_select(0, rows.ids_S) if on_device else None
        return self.sampler.sample(logits_NV.index_select(0, rows.sel_S), reqs, ids_S)

    @staticmethod
    def _sampling_seqs(inputs: StepInputs) -> torch.Tensor:
        """The sequence of each sampling row (a sequence's last row r lies in [q[b], q[b+1]): b = #{q[1:] <= r})."""
        B = inputs.sizes[1]
        ends_B = inputs.meta.query_start_loc_B1[1:B + 1].contiguous()
        return torch.searchsorted(ends_B, inputs.sample_rows_S.to(ends_B.dtype), right=True)

    # ------------------------------------------------------------------ the step under a mesh
    def hidden_input(self, path: int, inputs: StepInputs) -> torch.Tensor:
        """Where a pipeline stage after the first receives the step's hidden states [T, D]."""
        return self.paths.hidden_input(path, inputs, self.arch.hidden_size, self.dtype)

    def with_replica_samples(self, inputs: StepInputs, counts: List[int]) -> StepInputs:
        """The sampling rank on a later stage, under attention data parallelism: which of the gathered sampling rows
        are real (each replica's first counts[r] of sizes' S), from the driver's host ints."""
        from dataclasses import replace

        from moe_infer.engine.dp_inputs import DPRows

        S = inputs.sizes[2]
        sel = [r * S + i for r, n in enumerate(counts) for i in range(n)]
        return replace(inputs, dp=DPRows(sel_S=torch.tensor(sel, dtype=torch.int64, device=self.device)))

    # the plan <-> sampled rows mapping and the step message's layout, for the step pipeline (which knows no plan or
    # input format)
    plan_requests = staticmethod(plan_requests)
    per_plan_entry = staticmethod(per_plan_entry)
    fill_placeholders = staticmethod(fill_placeholders)
    launched = staticmethod(LaunchedStep)
    message_layout = staticmethod(message_layout)

    def reset_stats(self) -> None:
        """Zero the expert-load statistics here; under a mesh the next step tells the other ranks."""
        if self.stats is not None:
            self.stats.reset()
            self.encoder.reset_stats = True
