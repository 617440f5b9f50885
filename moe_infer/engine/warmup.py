"""Start-up warm-up of the Triton kernels: every kernel variant a step can select is compiled (or loaded
from Triton's disk cache) before the first request, so that no step of any size pays a JIT compile while
serving (on an H100 one took hundreds of ms in the middle of a timed serving level).

Triton compiles one variant of a kernel per specialization: its constexprs (the block sizes and configs
the launch wrappers choose) and, for every other int and pointer argument, whether it is 1 and whether it
is divisible by 16. The kernels mark the arguments that follow the step's size `do_not_specialize`
(moe_infer/kernels), so what is left varies with the step only through the wrappers' choices, which are
functions of:
  - the token count T and the routed rows N = T*K, through their powers of two (block sizes from
    `triton.next_power_of_2`, the fused MoE schedule backend by thresholds on N);
  - the fused MoE config, tuned per token count, and the expert GEMMs' row and tile counts, which stay
    specialized (`launch_variant` of the experts backend);
  - decode or not (the attention tiles), and for decode the batch and the context length (the split count and
    key tile, `moe_infer.kernels.paged_attention.decode_tiles`).
`warmup_token_counts` gives one T for each distinct combination up to the largest step, `warmup_decode_shapes`
one (batch, context) decode for each distinct decode tile pair; `warmup_kernels` runs an eager forward at each.
The GPU test (tests/test_jit_warmup.py) runs steps of many sizes after start-up and counts Triton compiles: none.

Compiling in parallel (`model.compile_workers`, CUDA): the forwards first run dry, each inside a CUDA graph
capture that is thrown away, with Triton launching nothing (`moe_infer.kernels.precompile.dry_launches`): every
variant they select that is not in Triton's disk cache goes to a pool of worker processes; then the forwards run
for real and load those from disk. A warm start (every variant on disk) loads them in the dry pass and stops
there. Anything that fails on the way (a capture, a worker) is logged once and leaves the kernels to the real
forwards, which compile what is still missing one after the other, as with compile_workers=0 (and always under
a mesh, where a rank whose dry pass failed would leave the others waiting in their collectives).

The forwards run padding rows only: no K/V slot written (slot -1), keys read from block 0, every row left
out of the expert-load statistics (valid_T all False). Resident experts only (an offloading store would move
experts for the padding rows); under a mesh every rank runs the same forwards (no pipeline stages).

Legend: T tokens, K top-k, N = T*K routed rows, B sequences, L context length.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch

from moe_infer.engine.cuda_graph import gpu_note_level
from moe_infer.layers.forward_context import AttentionMetadata, forward_context
from moe_infer.layers.linear import graph_kernels

logger = logging.getLogger(__name__)


def pow2_buckets(n: int) -> tuple:
    """Which power-of-two ranges n lies in, (2^k, 2^(k+1)] (a next power of two) and [2^k, 2^(k+1))."""
    return (n - 1).bit_length(), n.bit_length()


def warmup_token_counts(max_tokens: int, top_k: int, config_of: Callable[[int], Hashable]) -> List[int]:
    """The smallest T of each distinct (powers of two of T and T*top_k, config_of(T)) over 1..max_tokens."""
    if max_tokens <= 0 or top_k <= 0:
        raise ValueError(f"max_tokens ({max_tokens}) and top_k ({top_k}) must be positive")
    first = {}
    for T in range(1, max_tokens + 1):
        first.setdefault((pow2_buckets(T), pow2_buckets(T * top_k), config_of(T)), T)
    return sorted(first.values())


def warmup_context_lengths(max_model_len: int) -> List[int]:
    """Decode context lengths: each power of two up to max_model_len, and max_model_len."""
    return sorted({1 << k for k in range(max_model_len.bit_length()) if 1 << k <= max_model_len} | {max_model_len})


def warmup_decode_shapes(max_batch: int, max_context: int, variant_of: Callable[[int, int], Hashable]
                         ) -> List[Tuple[int, int]]:
    """(batch B, context L) of the warm-up decodes: B = 1 at every `warmup_context_lengths` L, and the first (B, L)
    of each further variant_of(B, L) (the attention's decode tiles) over B in 1..max_batch and L at the edges of the
    powers of two (2^k, 2^k + 1) up to max_context, where the tile rules change."""
    if max_batch <= 0 or max_context <= 0:
        raise ValueError(f"max_batch ({max_batch}) and max_context ({max_context}) must be positive")
    first = {}
    edges = {n for k in range(max_context.bit_length()) for n in (1 << k, (1 << k) + 1) if n <= max_context}
    for L in sorted(edges | {max_context}):
        for B in range(1, max_batch + 1):
            first.setdefault(variant_of(B, L), (B, L))
    return sorted(set(first.values()) | {(1, L) for L in warmup_context_lengths(max_context)},
                  key=lambda bl: (bl[1], bl[0]))


def decode_variant_of(num_kv_heads: int, key_bytes: int, device: torch.device) -> Callable[[int, int], Hashable]:
    """(B, L) -> the decode attention's (split count, key tile) for B sequences over L keys."""
    from moe_infer.kernels.paged_attention import decode_tiles

    return lambda B, L: decode_tiles(B * num_kv_heads, L, key_bytes, device)


def moe_config_of(moe_layers: Sequence, experts_backend) -> Callable[[int], Hashable]:
    """T -> the experts backend's launch variant (config, specialized sizes) of every distinct MoE layer shape
    (None without one)."""
    launch_variant = getattr(experts_backend, "launch_variant", None)
    if launch_variant is None or not moe_layers:
        return lambda T: None
    shapes = {}
    for layer in moe_layers:
        if not getattr(layer, "can_fuse_experts", True):  # the backend's per-call path (GPT-OSS): no variants
            continue
        w13_E2FD = layer.store.weights()[0]
        shapes.setdefault((layer.spec.top_k, tuple(w13_E2FD.shape), w13_E2FD.dtype), (layer.spec.top_k, w13_E2FD))
    return lambda T: tuple(launch_variant(T, k, w13) for k, w13 in shapes.values())


def warmup_blocker(device: torch.device, backends, parallel) -> Optional[str]:
    """Why this engine skips the warm-up; None when it runs. Under a mesh every rank runs the same forwards, their
    collectives in step (they are the same on every rank), except with pipeline stages (a later stage's forward needs
    the stage before's hidden states) or an all-to-all dispatcher (its host-side split sizes)."""
    if device.type != "cuda":
        return f"no Triton kernels on {device.type}"
    if parallel.is_distributed and parallel.dims.pp > 1:
        return "pipeline stages (a later stage runs on the hidden states of the stage before)"
    if backends.store != "resident":
        return "offloaded experts"
    if backends.dispatcher is not None and not getattr(backends.dispatcher, "graph_safe", False):
        return "expert parallelism through an all-to-all dispatcher"
    return None


def padding_step(lengths: Sequence[int], block_size: int, device: torch.device, max_seq_len: int = 0):
    """(input_ids_T, metadata, valid_T) of sequences of the given query lengths, each its whole context, made
    of padding rows: token 0, no slot written, keys from block 0. max_seq_len (decode) widens the block table
    and the host-side context length; the device-side lengths stay the query lengths."""
    T, B = sum(lengths), len(lengths)
    max_seq_len = max(max_seq_len, *lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        positions_T=torch.cat([torch.arange(n) for n in lengths]).to(device),
        slot_mapping_T=torch.full((T,), -1, dtype=torch.int64, device=device),
        block_tables_BM=torch.zeros(B, -(-max_seq_len // block_size), dtype=torch.int32, device=device),
        query_start_loc_B1=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens_B=torch.tensor(lengths, dtype=torch.int32, device=device), max_query_len=max(lengths),
        max_seq_len=max_seq_len, block_size=block_size,
    )
    return torch.zeros(T, dtype=torch.int64, device=device), meta, torch.zeros(T, dtype=torch.bool, device=device)


@torch.inference_mode()
def warmup_kernels(model, token_counts: Sequence[int], decode_shapes: Sequence[Tuple[int, int]], max_model_len: int,
                   block_size: int, device: torch.device, last_rows: bool = False,
                   last_row_shapes: Sequence[Tuple[int, int]] = (), compile_workers: int = 0,
                   act_dtype: Optional[torch.dtype] = None) -> float:
    """One eager forward per token count (sequences of at most max_model_len tokens), then a decode of B
    one-token sequences over L keys per (B, L) of decode_shapes. With last_rows (the runner's: a prompt step's last
    layer runs each sequence's last row, attended as a decode, moe_infer/layers/last_rows.py), every forward runs
    so, and a step of B two-token sequences over L keys per (B, L) of last_row_shapes warms that decode attention.
    compile_workers > 0 (CUDA): the kernels missing from Triton's disk cache compiled first by that many worker
    processes (`precompile_in_workers`; the tables built on first use made first, in act_dtype, the activations'
    dtype: a capture cannot build them). Returns the seconds it took."""
    start = time.perf_counter()
    steps = [([max_model_len] * (T // max_model_len) + ([T % max_model_len] if T % max_model_len else []), 0)
             for T in token_counts]
    steps += [([1] * B, L) for B, L in decode_shapes]
    steps += [([2] * B, L) for B, L in (last_row_shapes if last_rows else ())]

    def forward(step) -> None:
        input_ids_T, meta, valid_T = step
        with forward_context(meta, valid_T=valid_T, last_rows=last_rows), graph_kernels():  # as the graphs select
            model(input_ids_T, meta.positions_T)

    def inputs():
        return (padding_step(lengths, block_size, device, max_seq_len) for lengths, max_seq_len in steps)

    if compile_workers > 0 and device.type == "cuda":
        build_lazy_tables(model, device, act_dtype)
        if precompile_in_workers(forward, inputs(), device, compile_workers) == 0:
            return time.perf_counter() - start  # every variant was on disk: loaded by the dry pass
    for step in inputs():
        forward(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def build_lazy_tables(model, device: torch.device, act_dtype: Optional[torch.dtype]) -> None:
    """The tables a layer builds on its first eager use (the rotary cos/sin table, per device and dtype), built now:
    the dry pass's captures cannot build them (layers/rotary.py refuses inside a capture)."""
    if act_dtype is None:
        return
    for module in model.modules():
        if hasattr(module, "cos_sin_cache"):
            module.cos_sin_cache(device, act_dtype)


def precompile_in_workers(forward: Callable[[tuple], None], steps: Iterable[tuple], device: torch.device,
                          num_workers: int) -> Optional[int]:
    """The dry pass: forward(step) for every step (its inputs, made outside the capture: host-to-device copies are not
    capturable) inside a CUDA graph capture that is dropped, Triton launching nothing; the variants missing from
    the disk cache compiled by num_workers processes meanwhile, waited for.
    A step whose capture fails is left to the real forwards (the others' variants still compile in the workers).
    Returns how many were sent to them (0: all were on disk, and are loaded now; never 0 where a step failed), None
    where every step failed (logged; the real forwards compile what is missing)."""
    try:
        from triton.runtime.driver import driver

        from moe_infer.kernels.precompile import CompilePool, dry_launches
    except ImportError as err:
        logger.info("Triton kernels compile in the engine's process: %s", err)
        return None
    pool = CompilePool(num_workers, driver.active.get_current_target())
    failed, num_steps, step_errors, graphs = None, 0, [], []
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        mempool = torch.cuda.graph_pool_handle()  # one pool: a step's captured activations reused by the next
        with dry_launches(pool.submit), torch.cuda.stream(stream):
            for step in steps:
                num_steps += 1
                try:
                    dry_capture(forward, step, mempool, graphs)
                except Exception as err:  # noqa: BLE001 - this step's kernels compile in its real forward
                    step_errors.append(f"{type(err).__name__}: {err}")
        torch.cuda.current_stream(device).wait_stream(stream)
        graphs.clear()  # the pool's last users: its memory freed
        del mempool
        torch.cuda.empty_cache()  # the dry captures' memory back to the device
    except Exception as err:  # noqa: BLE001 - any failure leaves the compiles to the real forwards
        failed = f"{type(err).__name__}: {err}"
    if failed is None and step_errors and len(step_errors) == num_steps:
        failed = step_errors[0]
    compiled, errors = pool.finish()
    if pool.num_submitted:
        logger.info("Triton kernels: %d of %d variants compiled by %d worker processes in %.1f s", compiled,
                    pool.num_submitted, pool.num_workers, pool.seconds)
    if pool.launcher_errors:
        logger.info("%d Triton kernel launchers left to the kernels' first launch: %s", len(pool.launcher_errors),
                    pool.launcher_errors[0])
    if errors:
        logger.warning("%d Triton kernel variants were not compiled in parallel (compiled in the engine's process "
                       "instead): %s", len(errors), "; ".join(errors[:3]))
    if failed is not None:
        logger.warning("the dry pass of the Triton warm-up failed (the kernels compile in the engine's process, one "
                       "after the other): %s", failed)
        return None
    if step_errors:
        logger.warning("the dry pass of the Triton warm-up failed in %d of %d steps (their kernels compile in the "
                       "engine's process): %s", len(step_errors), num_steps, step_errors[0])
        return pool.num_submitted + len(step_errors)
    return pool.num_submitted


def dry_capture(forward: Callable[[tuple], None], step: tuple, mempool, graphs: list) -> None:
    """forward(step) inside a CUDA graph capture that is never replayed: the torch ops are captured, never run, so no
    value is ever read; the capture ends (and the stream leaves capture mode) whether or not forward raised. The graph
    joins graphs, kept until the dry pass ends: a graph destroyed while tensors of its pool live leaves the pool unused
    but not freed, and the next capture into it fails the caching allocator's use-count assert (seen on the H200)."""
    graph = torch.cuda.CUDAGraph()
    graphs.append(graph)
    graph.capture_begin(pool=mempool, capture_error_mode="thread_local")
    try:
        forward(step)
    finally:
        graph.capture_end()


def warmup_plan(runner) -> Tuple[List[int], List[Tuple[int, int]], List[Tuple[int, int]]]:
    """(token counts, decode shapes, last-row shapes) a ModelRunner's warm-up runs: steps of up to
    max_num_batched_tokens tokens (and the decode batches its CUDA graphs pad to); decodes of up to max_num_seqs
    sequences over contexts up to the widest block table; where the runner prunes its last layer, the decodes that
    layer attends as, up to the prefill graphs' padded sequence count (max_num_seqs + 1 to a power of two)."""
    from moe_infer.experts.reference import EXPERT_BACKENDS

    cfg = runner.cfg
    max_tokens = max(cfg.scheduler.max_num_batched_tokens,
                     min(cfg.model.cuda_graph_max_batch, cfg.scheduler.max_num_seqs))
    config_of = moe_config_of(runner.model.moe_layers(), EXPERT_BACKENDS.get(runner.backends.experts))
    max_context = -(-runner.max_model_len // runner.block_size) * runner.block_size
    key_bytes = runner.arch.head_dim * torch.finfo(runner.dtype).bits // 8
    layer_attn = runner.model.layers[runner.model.local_layers[0]].self_attn
    if hasattr(layer_attn, "decode_variant"):  # MLA: its own kernel's variants
        variant_of = lambda B, L: layer_attn.decode_variant(B, L, runner.device)  # noqa: E731
    else:
        variant_of = decode_variant_of(runner.model.num_kv_heads, key_bytes, runner.device)
    last_row_batch = 1 << cfg.scheduler.max_num_seqs.bit_length()  # next_pow2(max_num_seqs + 1): ExtendGraphs' Bp
    return (warmup_token_counts(max_tokens, runner.arch.top_k, config_of),
            warmup_decode_shapes(cfg.scheduler.max_num_seqs, max_context, variant_of),
            warmup_decode_shapes(last_row_batch, max_context, variant_of) if runner.last_rows else [])


def warm_up_runner(runner) -> Optional[float]:
    """A ModelRunner's start-up warm-up (`warmup_plan`): the seconds it took, None where skipped (logged)."""
    why_not = warmup_blocker(runner.device, runner.backends, runner.parallel)
    if why_not:
        logger.log(gpu_note_level(runner.device), "no start-up warm-up of the Triton kernels: %s", why_not)
        return None
    counts, decodes, last_rows = warmup_plan(runner)
    workers = compile_workers(runner)
    seconds = warmup_kernels(runner.model, counts, decodes, runner.max_model_len, runner.block_size, runner.device,
                             runner.last_rows, last_rows, compile_workers=workers, act_dtype=runner.dtype)
    logger.info("Triton kernels warmed up in %.1f s: forwards of %d token counts (up to %d), %d + %d decodes (batch, "
                "context) for the attention's tiles", seconds, len(counts), counts[-1], len(decodes), len(last_rows))
    return seconds


def compile_workers(runner) -> int:
    """The worker processes of the runner's warm-up (0: the kernels compile in its process): model.compile_workers
    (None: `default_workers`), 0 under a mesh (a rank whose dry pass failed would leave the others waiting in their
    collectives) and where a step cannot be a CUDA graph for another reason than model.enforce_eager (the dry pass
    captures one: it would fail)."""
    from dataclasses import replace

    from moe_infer.engine.cuda_graph import graph_blocker

    cfg = runner.cfg
    if cfg.model.compile_workers == 0 or runner.parallel.is_distributed:
        return 0
    why_not = graph_blocker(replace(cfg, model=replace(cfg.model, enforce_eager=False)), runner.device,
                            runner.backends, model=runner.model)
    if why_not:
        logger.info("the Triton kernels compile in the engine's process, one after the other: %s", why_not)
        return 0
    if cfg.model.compile_workers is None:
        from moe_infer.kernels.precompile import default_workers

        return default_workers()
    return cfg.model.compile_workers
