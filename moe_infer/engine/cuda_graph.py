"""CUDA-graph replay of decode steps: one graph launch instead of hundreds of kernel launches.

A decode step (every sequence runs one token) has the same kernels every time; only the batch size
and the context length change. Eager, it is CPU-bound on kernel launches (the H100 profile in
benchmarks/results/profile_engine_*.json: ~490 launches for 4 layers, the GPU busy ~2.7 ms of
~16 ms). Like vLLM, the model forward of a decode step is captured once per shape bucket and
replayed: `load` lays the step out on the host as the graphs' static input buffers and one copy moves it
(moe_infer/engine/decode_buffers.py; the layer graphs fill the same buffers on the device, `_fill`), then
`replay` runs the graph, the LM head included, into one static logits buffer (without an LM head: the hidden
states come out of a static output tensor). Between two replays the GPU runs only that copy and the
sampler. The sampler stays eager (it reads per-request parameters).

Buckets: the batch is padded up to a capture size (1, 2, 4, then multiples of 8); the context
(keys gathered per sequence by the paged attention) up to a power-of-two number of blocks. A graph
is captured the first time its bucket is seen, after one eager warm-up run on the same buffers;
`warmup` (at engine start) has already compiled the Triton kernels for every capture size. Padded
rows are harmless: they write no KV slot (slot -1), attend over one key of block 0, and are masked
out of the expert-load statistics through the forward context's `valid_T`; their outputs are
never read.

Used only where the step is capturable and padding cannot change the result: CUDA, the resident expert store
(an offloading store decides copies on the host per layer), the dropless policy (a capacity would grow with
padding), an experts backend that runs without host syncs (one that declares `fused_experts`) and, under
expert parallelism, a dispatcher without host syncs (`graph_safe`: the reduce dispatcher). Anything else, or a
capture that fails, runs eagerly (the failure is logged once). Under a mesh every rank captures and replays
the same graphs, their collectives inside (tensor-parallel all-reduces, the EP reduction, the LM head's
all-gather and, as the graphs' `prologue` on the first stage, the broadcast of the driver's inputs); a capture
that fails there stops the engine (`MeshError`), since that rank could not keep in step with the others.

Speculative verify steps: where every sequence of a step runs the same q = k + 1 query tokens (its last token and k
proposals, each row sampled), the step replays a graph of its own per (Bp, Mp, q), up to `max_query_len` and
`max_verify_batch` sequences: the same static buffers (sized for Bmax_verify * q rows), the paged attention over q
queries a sequence inside the graph (causal among them; the attention backend must size its launches from the
bucket: `static_launch`), the LM head over every row. Padding sequences have q rows each (positions 0..q-1, keys of
block 0, no KV slot written). `verify_runs` counts those replays.

Legend: B sequences of the step, q query tokens a sequence (1: a decode step), T = B * q, Bp padded batch, Tp =
Bp * q, Bmax largest capture size, M blocks per sequence of the whole table, Mp blocks of the context bucket, D
hidden.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from moe_infer.engine.decode_buffers import DecodeBuffers
from moe_infer.engine.step_inputs import Sizes, StepInputs, host_segments
from moe_infer.layers.forward_context import AttentionMetadata, forward_context
from moe_infer.layers.linear import graph_kernels

logger = logging.getLogger(__name__)

ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids_T, positions_T) -> hidden_TD


def gpu_note_level(device: torch.device) -> int:
    """The level of a note that a GPU-only feature (graphs, the Triton warm-up) is off: DEBUG on the CPU, where it
    never applies (a CPU run's first lines were three such notes), INFO on a GPU, where it is news."""
    return logging.DEBUG if device.type == "cpu" else logging.INFO


def graph_blocker(cfg, device: torch.device, backends, whole_step: bool = True, mesh: bool = False,
                  model=None) -> Optional[str]:
    """Why decode steps of this engine cannot be replayed as CUDA graphs; None when they can.
    whole_step=False: why their attention parts cannot (engine/layer_graphs.py: the MoE layers eager).
    mesh: the engine runs under a mesh (its collectives are captured in the graphs: moe_infer/parallel/pipeline.py).
    model: the engine's model, whose MoE layers say whether the fused experts path can run them."""
    from moe_infer.experts.reference import EXPERT_BACKENDS

    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    if cfg.model.enforce_eager:
        return "model.enforce_eager=true"
    if whole_step and backends.store != "resident":
        return f"offload.store={backends.store} decides on the host, per layer, which experts to move"
    if backends.dispatcher is not None and not getattr(backends.dispatcher, "graph_safe", False):
        return (f"expert parallelism through an all-to-all dispatcher (parallel.dispatcher={cfg.parallel.dispatcher}: "
                f"split sizes on the host); the reduce dispatcher is graph-safe")
    if mesh and not whole_step:
        return "a mesh replays whole steps only (every rank must run the same graphs)"
    if mesh and os.environ.get("TORCH_NCCL_BLOCKING_WAIT") == "1":
        return "TORCH_NCCL_BLOCKING_WAIT=1 (the host would wait inside the captured collectives)"
    if backends.trace is not None:
        return "routing.trace=true (the recorder copies each step's routing eagerly)"
    if not whole_step:
        return None
    if backends.policy != "dropless":
        return f"routing.policy={backends.policy} (its capacity would count the padding rows)"
    if getattr(EXPERT_BACKENDS.get(backends.experts), "fused_experts", None) is None:
        return f"experts backend {backends.experts!r} syncs with the host"
    if model is not None and not all(layer.can_fuse_experts for layer in model.moe_layers()):
        return ("the model's experts (biases, GPT-OSS's clamped SwiGLU or mxfp4 weights) run the experts backend's "
                "per-call path, which syncs with the host")
    return None


def static_attention(model) -> Tuple[bool, str]:
    """(whether the model's attention sizes its launches from the bucket, its backend's name)."""
    from moe_infer.layers.paged_attention import ATTENTION_BACKENDS

    layer_attn = model.layers[model.local_layers[0]].self_attn
    static = getattr(layer_attn, "static_launch", None)  # MLA layers say it themselves
    name = layer_attn.backend
    return (static if static is not None else getattr(ATTENTION_BACKENDS.get(name), "static_launch", False)), name


def capture_graph(run: Callable[[], torch.Tensor], valid_R: torch.Tensor,
                  pool, mesh: bool = False) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its static output) of run(), a forward over static buffers whose padding mask is valid_R.

    Both runs are under `graph_kernels()` (the decode-sized linear kernel, moe_infer/layers/linear.py).
    One eager warm-up run first, on a side stream, for real on the step's buffers: it compiles what is
    not compiled yet and writes the same K/V the replay writes (same slots, same values); with valid_R all
    False meanwhile, it adds nothing to the expert-load statistics. Under a mesh (mesh=True) the warm-up run
    also makes every collective's communicator before the capture, and the capture is thread-local: NCCL's
    watchdog thread may query earlier work's events meanwhile, which a global capture forbids."""
    valid_copy_R = valid_R.clone()
    valid_R.fill_(False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), graph_kernels():
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local" if mesh else "global"), graph_kernels():
        out = run()
    valid_R.copy_(valid_copy_R)
    return graph, out


def replay_graph(owner, key, capture: Callable[[], Tuple[List[torch.cuda.CUDAGraph], torch.Tensor]],
                 what: str) -> Optional[torch.Tensor]:
    """The static output of owner's graphs for key after replaying them in order, captured first when new
    (`capture()` -> (graphs, output); owner: .graphs, .runs, .disabled, .mesh); None when the capture failed:
    owner.disabled says why and the caller runs that step, and every later one, eagerly. Under a mesh (owner.mesh)
    a failed capture raises the mesh's MeshError instead: the other ranks replay theirs, and a rank that fell back to
    eager steps would not run its collectives in step with them."""
    if key not in owner.graphs:
        try:
            owner.graphs[key] = capture()
        except Exception as err:  # noqa: BLE001 - any capture failure means: run these steps eagerly
            if getattr(owner, "mesh", False):  # not one step's failure: this rank cannot keep in step any more
                from moe_infer.parallel.health import MeshError

                raise MeshError(f"CUDA graph capture failed under a mesh for {what} (model.enforce_eager=true runs "
                                f"every step eagerly): {type(err).__name__}: {err}") from err
            torch.cuda.synchronize()
            owner.disabled = f"{type(err).__name__}: {err}"
            logger.warning("CUDA graph capture failed for %s; those steps run eagerly from now on (%s)", what,
                           owner.disabled)
            return None
    graphs, out = owner.graphs[key]
    for graph in graphs:
        graph.replay()
    owner.runs += 1
    return out


def capture_sizes(max_batch: int) -> List[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... up to max_batch (always included)."""
    if max_batch <= 0:
        raise ValueError(f"cuda graph max batch must be positive, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def context_blocks(num_blocks: int, max_blocks: int) -> int:
    """The context bucket in blocks: the next power of two, at most the table width."""
    bucket = 1
    while bucket < num_blocks:
        bucket *= 2
    return min(bucket, max_blocks)


class DecodeGraphs:
    """Static buffers + one captured graph per (padded batch, context bucket).

    capture=False runs the same padded, static-buffer forward eagerly: the padding logic is then
    testable without a GPU, and the result must equal the unpadded eager forward row for row.
    """

    def __init__(self, forward: ForwardFn, max_batch: int, max_blocks: int, block_size: int,
                 device: torch.device, capture: bool = True, lm_head=None,
                 hidden_in: Optional[Tuple[int, torch.dtype]] = None, mesh: bool = False,
                 prologue: Optional[Callable[[torch.Tensor], None]] = None, max_query_len: int = 1,
                 max_verify_batch: int = 0) -> None:
        """hidden_in (hidden size, dtype): a pipeline stage after the first, whose forward reads the previous
        stage's hidden states (`hidden_input`); mesh: under a mesh (collectives captured, capture failures raise);
        prologue(bytes): run first in every replayed step on the bytes it reads (`payload_region`): the mesh's
        broadcast of the driver's inputs into every rank's buffer, so that it costs no host time of its own.
        max_query_len, max_verify_batch: speculative verify steps of q <= max_query_len query tokens every sequence
        and at most max_verify_batch sequences (padded: a capture size) replay graphs too (1, 0: none)."""
        self.forward, self.block_size, self.max_blocks, self.mesh = forward, block_size, max_blocks, mesh
        self.prologue = prologue
        self.sizes = capture_sizes(max_batch)
        self.max_batch, self.capture = self.sizes[-1], capture
        Bmax, dev = self.max_batch, device
        self.max_query_len = max_query_len if max_verify_batch > 0 else 1
        self.max_verify_batch = (next(b for b in self.sizes if b >= min(max_verify_batch, Bmax))
                                 if max_verify_batch else 0)
        Tmax = max(Bmax, self.max_verify_batch * self.max_query_len)  # query rows
        self.bufs = DecodeBuffers(Bmax, max_blocks, dev, Tmax)  # the static inputs: views of one buffer (`load`)
        d = self.bufs.dev
        self.input_ids_B, self.positions_B, self.slot_mapping_B = d["ids"], d["positions"], d["slots"]
        self.block_tables_BM, self.seq_lens_B, self.valid_B = d["block_tables"], d["seq_lens"], d["valid"]
        self.query_start_loc_B1 = d["query_starts"]
        # with an LM head (a single rank's: `forward_into`), `load`ed steps replay it too, into one logits buffer
        self.lm_head = lm_head
        self.logits_BV = (None if lm_head is None else
                          torch.empty(Tmax, lm_head.vocab_size, dtype=lm_head.weight.dtype, device=dev))
        self.hidden_in_BD = (None if hidden_in is None else
                             torch.zeros(Tmax, hidden_in[0], dtype=hidden_in[1], device=dev))
        # the query starts of a verify step of q tokens a sequence: 0, q, 2q, ... (host, written at each `load`)
        self._query_starts = {q: np.arange(Bmax + 1, dtype=np.int32) * q for q in range(1, self.max_query_len + 1)}
        # keys: (Bp, Mp, with logits) for a decode step, (Bp, Mp, with logits, q) for a verify step of q > 1
        self.graphs: Dict[tuple, Tuple[List[torch.cuda.CUDAGraph], torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.disabled: Optional[str] = None  # why graphs were switched off after a failed capture
        self.runs = 0  # decode steps that went through the static buffers (replayed, or eager with capture=False)
        self.verify_runs = 0  # of those, speculative verify steps (q > 1 query tokens a sequence)

    def can_run(self, sizes) -> bool:
        """A pure decode step (one token per sequence) that fits the largest capture size, or a verify step of q
        query tokens every sequence, all of them sampled, that fits the verify graphs (sizes: the step's
        `step_inputs.Sizes`)."""
        T, B, S, m, q = sizes[:5]
        if self.disabled is not None or m > self.max_blocks:
            return False
        if q == 1:
            return T == B and T <= self.max_batch
        return q <= self.max_query_len and T == B * q and S == T and B <= self.max_verify_batch

    def _bucket(self, B: int, meta: AttentionMetadata) -> Tuple[int, int]:
        return self._bucket_of(B, meta.block_tables_BM.shape[1], meta.max_seq_len)

    def _bucket_of(self, B: int, table_width: int, max_seq_len: int) -> Tuple[int, int]:
        Bp = next(b for b in self.sizes if b >= B)
        need = max(table_width, -(-max_seq_len // self.block_size))
        return Bp, context_blocks(need, self.max_blocks)

    def _fill(self, input_ids_T: torch.Tensor, meta: AttentionMetadata, Bp: int) -> None:
        """Copies the step into the static buffers; rows B..Bp-1 become padding."""
        B, m = input_ids_T.shape[0], meta.block_tables_BM.shape[1]
        self.input_ids_B[:B].copy_(input_ids_T)
        self.positions_B[:B].copy_(meta.positions_T)
        self.slot_mapping_B[:B].copy_(meta.slot_mapping_T)
        self.block_tables_BM[:B].fill_(-1)
        self.block_tables_BM[:B, :m].copy_(meta.block_tables_BM)
        self.seq_lens_B[:B].copy_(meta.seq_lens_B)
        self.valid_B[:B].fill_(True)
        if Bp > B:
            self._pad(B, Bp)

    def _pad(self, B: int, Bp: int) -> None:
        """Rows B..Bp-1 become padding: token 0 at position 0, writes nothing, reads key 0 of block 0."""
        self.input_ids_B[B:Bp].zero_()
        self.positions_B[B:Bp].zero_()
        self.slot_mapping_B[B:Bp].fill_(-1)
        self.block_tables_BM[B:Bp].zero_()
        self.seq_lens_B[B:Bp].fill_(1)
        self.valid_B[B:Bp].fill_(False)

    def warmup(self) -> None:
        """One padded forward per capture size, every row padding (no KV slot written, nothing counted in
        the load statistics), at start-up: the Triton kernels compile for every batch a decode step can
        be padded to, so the first step of a new batch size costs a capture, not a JIT compile (H100,
        e2e batch 64: the first 64-sequence step took 570 ms, 457 ms of it compiling one schedule kernel)."""
        self._pad(0, self.max_batch)
        for Bp in self.sizes:
            self._run_static(Bp, 1)

    def _meta(self, Bp: int, Mp: int, q: int = 1) -> AttentionMetadata:
        Tp = Bp * q
        return AttentionMetadata(
            positions_T=self.positions_B[:Tp], slot_mapping_T=self.slot_mapping_B[:Tp],
            block_tables_BM=self.block_tables_BM[:Bp, :Mp], query_start_loc_B1=self.query_start_loc_B1[:Bp + 1],
            seq_lens_B=self.seq_lens_B[:Bp], max_query_len=q, max_seq_len=Mp * self.block_size,
            block_size=self.block_size,
        )

    def _run_static(self, Bp: int, Mp: int, q: int = 1) -> torch.Tensor:
        Tp = Bp * q
        with forward_context(self._meta(Bp, Mp, q), valid_T=self.valid_B[:Tp]):
            if self.hidden_in_BD is None:
                return self.forward(self.input_ids_B[:Tp], self.positions_B[:Tp])
            return self.forward(self.input_ids_B[:Tp], self.positions_B[:Tp], self.hidden_in_BD[:Tp])

    def load(self, flat: np.ndarray, sizes: Sizes, num_extra: int) -> Tuple[StepInputs, torch.Tensor]:
        """The step of `flat_inputs`' buffer (its last num_extra entries: the caller's own), padding included,
        into the static buffers by one copy (`DecodeBuffers`) -> (its inputs for `replay`, the extra entries).
        Every element the bucket reads is written (the staging buffer holds an earlier step)."""
        B, m, max_seq_len = sizes[1], sizes[3], sizes[5]
        Bp, Mp = self._bucket_of(B, m, max_seq_len)
        self.stage_step(self.bufs.stage(), flat, sizes, num_extra)
        self.bufs.load(Bp)
        return self._inputs(sizes, Bp, Mp, num_extra)

    def stage_step(self, v, flat: np.ndarray, sizes: Sizes, num_extra: int) -> None:
        """Writes the step, padding included, into host views `v` laid out as the buffer (`load`'s staging, or a
        replica's segment under attention data parallelism: moe_infer/engine/dp_inputs.py)."""
        T, B, S, m, q, max_seq_len = sizes
        Bp, _ = self._bucket_of(B, m, max_seq_len)
        Tp = Bp * q
        src = host_segments(flat, sizes)
        v["ids"][:T], v["ids"][T:Tp] = src.ids_T, 0  # rows T..Tp-1: padding (see `_pad`)
        v["positions"][:T], v["slots"][:T] = src.positions_T, src.slots_T
        if q == 1:
            v["positions"][T:Tp] = 0
        else:  # a padding sequence's q rows: positions 0..q-1 (the attention reads keys 0..q-1 of block 0)
            v["positions"][T:Tp] = np.tile(np.arange(q), Bp - B)
        if self.max_query_len > 1:  # the staging buffer may hold another q's query starts
            v["query_starts"][:Bp + 1] = self._query_starts[q][:Bp + 1]
        v["slots"][T:Tp] = -1
        v["seq_lens"][:B], v["seq_lens"][B:Bp] = src.seq_lens_B, q
        v["valid"][:T], v["valid"][T:Tp] = True, False
        tables = v["block_tables"]
        tables[:B, :m], tables[:B, m:], tables[B:Bp] = src.block_tables_BM, -1, 0
        v["sample_rows"][:S], v["extra"][:num_extra] = src.sample_rows_S, src.extra

    def receive(self, sizes: Sizes, num_extra: int, fill: Callable[[torch.Tensor], None]) -> Tuple[StepInputs, torch.Tensor]:
        """Another rank's `load` of the same step: fill(bytes) writes the bytes that rank loaded (its `payload`,
        received over the mesh) into this rank's buffer -> as `load`."""
        Bp, Mp = self._bucket_of(*self._bucket_args(sizes))
        fill(self.bufs.buffer[:self.bufs.nbytes(Bp)])
        return self._inputs(sizes, Bp, Mp, num_extra)

    def payload(self, inputs: StepInputs) -> torch.Tensor:
        """The bytes of the buffer a `load`ed step reads (uint8, on the device): what the other ranks receive."""
        return self.payload_region(inputs.decode_bucket[0])

    def hidden_input(self, inputs: StepInputs) -> torch.Tensor:
        """Where a pipeline stage after the first receives the step's hidden states [B, D] (its graphs read them)."""
        return self.hidden_in_BD[:inputs.sizes[1]]

    @staticmethod
    def _bucket_args(sizes: Sizes) -> Tuple[int, int, int]:
        return sizes[1], sizes[3], sizes[5]

    def _inputs(self, sizes: Sizes, Bp: int, Mp: int, num_extra: int) -> Tuple[StepInputs, torch.Tensor]:
        T, S, q = sizes[0], sizes[2], sizes[4]
        d = self.bufs.dev
        inputs = StepInputs(self.input_ids_B[:T], functools.partial(self._step_meta, sizes), d["sample_rows"][:S],
                            sizes, decode_bucket=(Bp, Mp, q))
        return inputs, d["extra"][:num_extra]

    def _step_meta(self, sizes: Sizes) -> AttentionMetadata:
        """The step's own (unpadded) attention metadata over the static buffers: for an eager run."""
        T, B, _, m, max_query_len, max_seq_len = sizes
        return AttentionMetadata(
            positions_T=self.positions_B[:T], slot_mapping_T=self.slot_mapping_B[:T],
            block_tables_BM=self.block_tables_BM[:B, :m], query_start_loc_B1=self.query_start_loc_B1[:B + 1],
            seq_lens_B=self.seq_lens_B[:B], max_query_len=max_query_len, max_seq_len=max_seq_len,
            block_size=self.block_size)

    def replay(self, inputs: StepInputs) -> Optional[torch.Tensor]:
        """For a step `load`ed into the buffers: logits [T, V] with an LM head (`with_logits`), else hidden [T, D];
        None when the graph could not be captured (run eagerly)."""
        Bp, Mp, q = inputs.decode_bucket
        return self._replay(inputs.input_ids_T.shape[0], Bp, Mp, self.with_logits, q)

    @property
    def with_logits(self) -> bool:
        return self.lm_head is not None

    def _run_static_logits(self, Bp: int, Mp: int, q: int = 1) -> torch.Tensor:
        return self.lm_head.forward_into(self._run_static(Bp, Mp, q), self.logits_BV[:Bp * q])

    def payload_region(self, padded_batch: int) -> torch.Tensor:
        """The bytes a step padded to padded_batch rows reads (what the prologue broadcasts)."""
        return self.bufs.buffer[:self.bufs.nbytes(padded_batch)]

    def _replay(self, T: int, Bp: int, Mp: int, logits: bool, q: int = 1) -> Optional[torch.Tensor]:
        forward = (lambda: self._run_static_logits(Bp, Mp, q)) if logits else (lambda: self._run_static(Bp, Mp, q))
        run = forward
        if self.prologue is not None:
            def run():
                self.prologue(self.payload_region(Bp))
                return forward()
        if not self.capture:
            self.runs += 1
            self.verify_runs += q > 1
            return run()[:T]

        def capture():
            graph, out = capture_graph(run, self.valid_B, self.pool, mesh=self.mesh)
            return [graph], out

        what = (f"a {'decode' if q == 1 else f'verify ({q} tokens a sequence)'} step at batch {Bp}, {Mp} blocks"
                f"{' with the LM head' if logits else ''}")
        out_Tp = replay_graph(self, (Bp, Mp, logits) if q == 1 else (Bp, Mp, logits, q), capture, what)
        if out_Tp is not None:
            self.verify_runs += q > 1
        return None if out_Tp is None else out_Tp[:T]
