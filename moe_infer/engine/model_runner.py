"""The model runner: loads the model, owns the KV cache, turns a step's plan into tensors, runs, samples.

It never decides policy: the plan (`SchedulerOutput`) says which tokens of which sequences run and
which sequences sample. The step's tensors are built once, on the host then copied: input ids,
positions, slot mapping, block tables, query_start_loc, seq lens. Logits are computed only for the
last token of each sequence that samples (a decode, or the chunk that ends a prompt).

Legend: T tokens of the step, B sequences of the step, S sequences that sample, M max blocks per
sequence, V vocabulary, D hidden.
"""
from __future__ import annotations

import logging
import time
from array import array
from typing import List, Optional, Tuple

import torch

from moe_infer.config import EngineConfig
from moe_infer.engine.backends import offload_manager, resolve_moe_backends
from moe_infer.engine.cuda_graph import DecodeGraphs, graph_blocker
from moe_infer.layers.forward_context import AttentionMetadata, forward_context
from moe_infer.engine.sampler import SampleRequest, Sampler, SamplerOutput
from moe_infer.engine.sequence import SchedulerOutput
from moe_infer.parallel.engine_hooks import agree_min, expert_dispatcher, init_engine_parallel
from moe_infer.routing.stats import ExpertLoadStats
from moe_infer.routing.trace_recorder import RoutingTraceRecorder

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 4 << 30  # the most a CPU KV cache takes when num_kv_blocks is not given


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_path: str, device: torch.device, dtype: torch.dtype,
                 parallel=None) -> None:
        from moe_infer.models import load_model

        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.block_size = cfg.cache.block_size
        self.backends = resolve_moe_backends(cfg, device)
        self.parallel = parallel if parallel is not None else init_engine_parallel(cfg)
        self.backends.dispatcher = expert_dispatcher(self.parallel, cfg, model_path)  # None: all experts here
        self.offload = self.backends.offload = offload_manager(cfg, model_path, device, dtype, self.backends)
        self.model = load_model(model_path, dtype, device, self.backends, cfg.model.attention_backend,
                                load_format=cfg.model.load_format)
        if self.offload is not None:  # NVMe files synced, the cost model measured; KV is sized after the cache
            self.offload.finish_load()
        arch = self.model.arch
        self.arch = arch
        self.stats: Optional[ExpertLoadStats] = None
        if cfg.routing.collect_stats:
            self.stats = ExpertLoadStats(arch.num_layers, arch.num_experts, device)
            self.backends.stats = self.stats  # the MoE layers share this MoEBackends object
        self.trace: Optional[RoutingTraceRecorder] = None
        if cfg.routing.trace and self.parallel.is_driver:  # every EP rank routes the same tokens
            self.trace = RoutingTraceRecorder(arch.moe_layer_ids, arch.num_experts, arch.top_k, device,
                                              cfg.routing.trace_logits, cfg.routing.trace_max_tokens)
            self.backends.trace = self.trace
        self.max_model_len = min(cfg.model.max_model_len or arch.max_position_embeddings,
                                 arch.max_position_embeddings)
        if cfg.model.max_model_len and cfg.model.max_model_len > arch.max_position_embeddings:
            raise ValueError(f"model.max_model_len={cfg.model.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings={arch.max_position_embeddings}")
        self.num_kv_blocks = agree_min(self.parallel, self._num_kv_blocks())  # the same block ids on every rank
        self.kv_caches = self._allocate_kv_cache(self.num_kv_blocks)
        self.model.bind_kv_cache(self.kv_caches)
        self.sampler = Sampler(arch.vocab_size, arch.eos_token_ids, device, seed=cfg.seed)
        self.graphs = self._decode_graphs()
        self.rebalancer = None
        if cfg.parallel.enable_eplb:  # online expert re-balancing (moe_infer/parallel/rebalance.py)
            if self.parallel.dims.ep == 1:
                raise ValueError("parallel.enable_eplb=true needs expert parallelism (parallel.ep > 1)")
            from moe_infer.parallel.rebalance import OnlineRebalancer

            self.rebalancer = OnlineRebalancer(self.parallel, self.model.moe_layers(), self.stats,
                                               cfg.parallel.eplb_step_interval)

    def _decode_graphs(self) -> Optional[DecodeGraphs]:
        """CUDA-graph replay of decode steps where it is safe (see moe_infer/engine/cuda_graph.py)."""
        why_not = graph_blocker(self.cfg, self.device, self.backends)
        if why_not:
            logger.info("decode steps run eagerly: %s", why_not)
            return None
        max_blocks = -(-self.max_model_len // self.block_size)
        graphs = DecodeGraphs(self.model, min(self.cfg.model.cuda_graph_max_batch, self.cfg.scheduler.max_num_seqs),
                              max_blocks, self.block_size, self.device)
        start = time.perf_counter()
        with torch.inference_mode():  # as the steps run (execute)
            graphs.warmup()
        logger.info("decode kernels warmed up for batch sizes %s in %.1f s", graphs.sizes, time.perf_counter() - start)
        return graphs

    # ------------------------------------------------------------------ KV cache
    def _num_kv_blocks(self) -> int:
        bytes_per_block = self.model.kv_cache_bytes_per_block(self.block_size)
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        useful = blocks_per_seq * self.cfg.scheduler.max_num_seqs  # more can never be used at once
        if self.cfg.cache.num_kv_blocks is not None:
            return self.cfg.cache.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - self.cfg.cache.gpu_memory_utilization) - self._activation_bytes()
            num = min(int(budget // bytes_per_block), useful)
            if num < blocks_per_seq:
                raise RuntimeError(
                    f"only {max(num, 0)} KV blocks fit in GPU memory (free {free / 2**30:.1f} GiB, "
                    f"gpu_memory_utilization={self.cfg.cache.gpu_memory_utilization}); one sequence of "
                    f"max_model_len={self.max_model_len} needs {blocks_per_seq}: lower max_model_len")
            return num
        return max(1, min(useful, CPU_KV_CACHE_BYTES // bytes_per_block))

    def _activation_bytes(self) -> int:
        """A generous bound on one step's activations (MoE rows dominate), kept out of the KV budget."""
        T = self.cfg.scheduler.max_num_batched_tokens
        hf = self.model.hf_config
        D = getattr(hf, "hidden_size", 4096)
        F = max(getattr(hf, "moe_intermediate_size", 0) or 0, getattr(hf, "intermediate_size", 0) or 0)
        elem = torch.finfo(self.dtype).bits // 8
        return int(T * (16 * D + 6 * self.arch.top_k * F) * elem + self.cfg.scheduler.max_num_seqs
                   * self.arch.vocab_size * 4 * 4) + (512 << 20)

    def _allocate_kv_cache(self, num_blocks: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        a = self.arch
        shape = (num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(a.num_layers)]

    # ------------------------------------------------------------------ the step
    def prepare(self, plan: SchedulerOutput) -> Tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """input_ids_T, the attention metadata and the row of each sampling sequence's last token.

        Built as Python lists and moved to the device in one copy (one int64 buffer, sliced on the
        device) instead of a host tensor op and a copy per field; host time per step in
        benchmarks/results/engine_steps_*.json."""
        seqs, bs = plan.seqs, self.block_size
        B = len(seqs)
        max_blocks = max(len(s.block_table) for s in seqs)
        ids: List[int] = []
        positions: List[int] = []
        slots: List[int] = []
        tables: List[int] = []
        query_start, seq_lens, sample_rows = [0], [], []
        max_query_len = 0
        for s in seqs:
            start, table, n = s.start_pos, s.block_table, len(s.token_ids)
            ids += s.token_ids
            positions += range(start, start + n)
            pos, end = start, start + n
            while pos < end:  # the KV slots, one block at a time
                i = pos // bs
                stop, base = min(end, (i + 1) * bs), (table[i] - i) * bs
                slots += range(base + pos, base + stop)
                pos = stop
            tables += table
            tables += [-1] * (max_blocks - len(table))
            query_start.append(query_start[-1] + n)
            seq_lens.append(start + n)
            max_query_len = max(max_query_len, n)
            if s.do_sample:
                sample_rows.append(query_start[-1] - 1)
        T, S = len(ids), len(sample_rows)
        host = array("q", ids + positions + slots + query_start + seq_lens + sample_rows + tables)
        flat = torch.frombuffer(host, dtype=torch.int64).to(self.device, non_blocking=True)  # no per-int boxing
        input_ids_T, positions_T, slot_mapping_T, query_start_loc_B1, seq_lens_B, sample_rows_S, block_tables_BM = (
            flat.split([T, T, T, B + 1, B, S, B * max_blocks]))
        meta = AttentionMetadata(
            positions_T=positions_T, slot_mapping_T=slot_mapping_T,
            block_tables_BM=block_tables_BM.view(B, max_blocks).to(torch.int32),
            query_start_loc_B1=query_start_loc_B1.to(torch.int32), seq_lens_B=seq_lens_B.to(torch.int32),
            max_query_len=max_query_len, max_seq_len=max(seq_lens), block_size=bs,
        )
        return input_ids_T, meta, sample_rows_S

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> Tuple[List[Optional[int]], List[Optional[tuple]]]:
        """Runs one step; returns per plan entry the sampled token (None: no sample) and its logprobs."""
        self.sampler.forget(plan.finished_seq_ids)
        if plan.is_empty:
            return [], []
        if self.rebalancer is not None:  # between steps: every EP rank runs the same plans in order
            self.rebalancer.step()
        input_ids_T, meta, sample_rows_S = self.prepare(plan)
        hidden_TD = None
        if self.graphs is not None and self.graphs.can_run(input_ids_T.shape[0], meta):
            hidden_TD = self.graphs.run(input_ids_T, meta)  # None: the capture failed, run eagerly
        if hidden_TD is None:
            if self.trace is not None:
                self.trace.begin_step(meta.positions_T, input_ids_T.shape[0])
            with forward_context(meta):
                hidden_TD = self.model(input_ids_T, meta.positions_T)
        sampling = [s for s in plan.seqs if s.do_sample]
        tokens: List[Optional[int]] = [None] * len(plan.seqs)
        logprobs: List[Optional[tuple]] = [None] * len(plan.seqs)
        if not sampling:
            return tokens, logprobs
        logits_SV = self.model.compute_logits(hidden_TD[sample_rows_S])
        reqs = [SampleRequest(s.seq_id, s.params, s.num_prompt_tokens,
                              s.start_pos + len(s.token_ids) - s.num_prompt_tokens, s.history) for s in sampling]
        out: SamplerOutput = self.sampler(logits_SV, reqs)
        it = iter(zip(out.token_ids, out.logprobs))
        for i, s in enumerate(plan.seqs):
            if s.do_sample:
                tokens[i], logprobs[i] = next(it)
        return tokens, logprobs
