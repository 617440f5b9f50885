"""The model runner's CUDA graphs: which kinds a runner gets (decode steps whole, each layer's attention part, prefill
and mixed steps), decided from its config, model and mesh, and their buffers set up at start-up.

`set_up_graphs(runner)` is the start-up's cuda_graphs part: it sets runner.graphs (DecodeGraphs), runner.layer_graphs
(LayerGraphs) and runner.extend_graphs (ExtendGraphs), each None where that kind cannot run (logged once, saying why),
and under a mesh frees them before the process groups go. The graphs themselves are moe_infer/engine/cuda_graph.py,
layer_graphs.py and extend_graph.py.
"""
from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from typing import Optional

import torch

from moe_infer.engine.cuda_graph import DecodeGraphs, gpu_note_level, graph_blocker, static_attention
from moe_infer.engine.extend_graph import ExtendGraphs
from moe_infer.engine.layer_graphs import LayerGraphs

logger = logging.getLogger(__name__)


def set_up_graphs(runner) -> None:
    """The runner's graphs and their warm-up forwards (captured at first use)."""
    runner.graphs = decode_graphs(runner)
    runner.layer_graphs = layer_graphs(runner)
    offload = runner.offload
    if offload is not None and offload.expert_graphs is not None and runner.cfg.model.enforce_eager:
        logger.info("offload.expert_graphs is off: model.enforce_eager=true")  # no CUDA graph of any kind
        offload.expert_graphs = None
    runner.extend_graphs = extend_graphs(runner)
    if runner.parallel.is_distributed:  # the graphs go before the process groups (parallel/context.py)
        runner.parallel.on_teardown(functools.partial(_free_graphs_of, weakref.ref(runner)))


def decode_graphs(runner) -> Optional[DecodeGraphs]:
    """CUDA-graph replay of decode steps where it is safe (see moe_infer/engine/cuda_graph.py)."""
    why_not = graph_blocker(runner.cfg, runner.device, runner.backends, mesh=runner.parallel.is_distributed,
                           model=runner.model)
    if why_not:
        logger.log(gpu_note_level(runner.device), "decode steps run eagerly: %s", why_not)
        return None
    from moe_infer.engine.speculative.graphs import verify_graph_shape

    max_blocks = -(-runner.max_model_len // runner.block_size)
    max_batch = min(runner.cfg.model.cuda_graph_max_batch, runner.cfg.scheduler.max_num_seqs)
    max_q, max_verify = verify_graph_shape(runner.cfg, runner.model, max_batch)  # speculative verify steps
    graphs = DecodeGraphs(runner.model, max_batch, max_blocks, runner.block_size, runner.device,
                          lm_head=graph_lm_head(runner), hidden_in=hidden_in(runner),
                          mesh=runner.parallel.is_distributed, prologue=graph_prologue(runner), max_query_len=max_q,
                          max_verify_batch=max_verify)
    start = time.perf_counter()
    with torch.inference_mode():  # as the steps run (execute)
        graphs.warmup()
    logger.info("decode kernels warmed up for batch sizes %s in %.1f s", graphs.sizes, time.perf_counter() - start)
    return graphs


def graph_prologue(runner):
    """On the first pipeline stage of a mesh: the broadcast of the driver's step inputs over the stage, which the
    graphs run first in every replayed step (no host time of its own); None elsewhere."""
    ctx = runner.parallel
    if not (ctx.is_distributed and ctx.is_first_stage and ctx.stage_axis().communicates):
        return None
    if runner.dp.communicates:  # every replica's segment broadcast, this one's copied where the graphs read it
        return lambda region_U: runner.dp_paths.prologue(region_U, ctx.stage_broadcast)
    return ctx.stage_broadcast


def hidden_in(runner):
    """(hidden size, dtype) of the previous stage's hidden states a stage after the first reads; None on the first."""
    return None if runner.model.shard.is_first_stage else (runner.arch.hidden_size, runner.dtype)


def graph_lm_head(runner):
    """The LM head the decode graphs replay too (one that writes into their logits buffer), else None (and
    with MOE_GRAPH_LM_HEAD=0 in the environment: A/B runs)."""
    lm_head = getattr(runner.model, "lm_head", None)
    if runner.dp.communicates or runner.keep_hidden:  # the LM head runs on every replica's sampling rows, gathered
        return None  # (`sample`); or the step's hidden states are wanted (an MTP proposer)
    return lm_head if hasattr(lm_head, "forward_into") and os.environ.get("MOE_GRAPH_LM_HEAD", "1") != "0" else None


def layer_graphs(runner) -> Optional[LayerGraphs]:
    """Where decode steps cannot be one graph for their MoE layers' sake (an offloading store, a
    capacity policy, an experts backend that syncs): graphs of each layer's attention part
    (moe_infer/engine/layer_graphs.py)."""
    if runner.graphs is not None or runner.dp.communicates or graph_blocker(
            runner.cfg, runner.device, runner.backends, whole_step=False, mesh=runner.parallel.is_distributed,
            model=runner.model):
        return None
    logger.info("decode steps replay each layer's attention part as a CUDA graph, the MLPs eagerly")
    return LayerGraphs(runner.model, min(runner.cfg.model.cuda_graph_max_batch, runner.cfg.scheduler.max_num_seqs),
                       -(-runner.max_model_len // runner.block_size), runner.block_size, runner.device)


def extend_graph_tokens(runner) -> int:
    """The most tokens of a prefill / mixed step replayed as a CUDA graph here; 0 where none is (logged once)."""
    if runner._extend_tokens is not None:
        return runner._extend_tokens
    max_tokens = min(runner.cfg.model.cuda_graph_max_tokens, runner.cfg.scheduler.max_num_batched_tokens)
    static, attn = static_attention(runner.model)
    why_not = graph_blocker(runner.cfg, runner.device, runner.backends, mesh=runner.parallel.is_distributed,
                           model=runner.model)
    if why_not is None and max_tokens == 0:
        why_not = "model.cuda_graph_max_tokens=0"
    if why_not is None and not static:
        why_not = f"attention backend {attn!r} sizes its launches from the data"
    if why_not:
        logger.log(gpu_note_level(runner.device), "prefill and mixed steps run eagerly: %s", why_not)
    runner._extend_tokens = 0 if why_not else max_tokens
    return runner._extend_tokens


def extend_graphs(runner) -> Optional[ExtendGraphs]:
    """CUDA-graph replay of prefill and mixed steps where it is safe (moe_infer/engine/extend_graph.py)."""
    max_tokens = extend_graph_tokens(runner)
    if max_tokens == 0:
        return None
    return ExtendGraphs(runner.model, max_tokens, runner.cfg.scheduler.max_num_seqs,
                        -(-runner.max_model_len // runner.block_size), runner.block_size, runner.device,
                        pool=runner.graphs.pool if runner.graphs is not None else None, last_rows=runner.last_rows,
                        hidden_in=hidden_in(runner), mesh=runner.parallel.is_distributed,
                        prologue=graph_prologue(runner),
                        max_sample_rows=max_tokens if runner.cfg.speculative.enabled else None,
                        min_bucket=4 if runner.cfg.speculative.enabled else 16)


def _free_graphs_of(runner_ref) -> None:
    """Before the mesh's process groups are destroyed: free the runner's CUDA graphs (gone with it, if it is)."""
    runner = runner_ref()
    if runner is not None:
        if runner.device.type == "cuda":  # no replay of them still running
            torch.cuda.synchronize(runner.device)
        for holder in (runner.graphs, runner.extend_graphs, runner.layer_graphs):
            if holder is not None:  # their `graphs`: key -> (captured graphs, ...)
                for graphs, *_ in holder.graphs.values():
                    for graph in graphs:
                        graph.reset()
                holder.graphs.clear()
