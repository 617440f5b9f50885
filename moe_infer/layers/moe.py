"""The MoE layer: Router -> Capacity -> Dispatch -> Experts -> Combine (+ shared expert).

Each piece is chosen by name from its registry through `MoEBackends`, so a fused kernel, an
all-to-all dispatcher or an offloading store replaces exactly one piece.

Tensor parallel: each routed expert's F is split over `moe_tp` (the store holds the rank's F / moe_tp
rows of every local expert; ep = 1, tp > 1 is tensor-parallel MoE) and the shared expert's over `tp`;
both give partial sums, all-reduced once when the two axes are the same ranks, else one each. With the
reduce dispatcher (expert parallelism over replicated tokens) the routed partial sums span the whole
pipeline stage (`stage`): one all-reduce over it, the shared expert's included where tp spans the stage;
for a large step, as the dispatcher says (`micro_batches`), the tokens routed once run as M contiguous
chunks whose all-reduces are started asynchronously, each under the next chunk's experts.

Attention data parallelism (`dp`: the stage's attention replicas, each with its own T rows, padded alike by the
driver): the layer all-gathers the replicas' rows over `dp` ([dp*T, D], replica-major, with the padding mask), routes
them all, runs this rank's experts on the rows routed to them, adds the shared expert's tensor-parallel part of its
own replica's rows, and reduce-scatters over the stage (S ranks, replica-major: each gets T/tp rows of its replica's
sum), then all-gathers those over `tp`: each replica gets back the full output of its own rows only.

Legend: T tokens, D hidden, F expert intermediate, E experts, K top-k, R dispatched rows, C tokens of a chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_infer.experts.activation import SILU, ExpertAct, ExpertExtras
from moe_infer.experts.local_dispatch import LocalDispatcher
from moe_infer.experts.reference import EXPERT_BACKENDS
from moe_infer.layers.forward_context import at_forward_end, current_forward_context, valid_tokens
from moe_infer.layers.linear import linear
from moe_infer.quant import QuantSpec, make_linear
from moe_infer.offload.compute import slot_experts
from moe_infer.layers.tensor_parallel import SINGLE, RowParallelLinear, ShardGroup
from moe_infer.offload.store import EXPERT_STORES
from moe_infer.routing.capacity import CAPACITY_POLICIES
from moe_infer.routing.select import ROUTING_BACKENDS
from moe_infer.routing.spec import RoutingSpec
from moe_infer.routing.stats import ExpertLoadStats
from moe_infer.routing.trace_recorder import RoutingTraceRecorder

FUSED_FORMATS = ("fp8_block", "int4", "mxfp4")  # weight formats the fused experts kernels read (fused_experts_any)


@dataclass
class MoEBackends:
    """Resolved backend choices, shared by all MoE layers of a model."""

    routing: str = "torch"
    policy: str = "dropless"
    policy_kwargs: Dict[str, Any] = field(default_factory=dict)  # capacity_factor, min_capacity, drop_by
    experts: str = "torch"
    store: str = "resident"
    dispatcher: Optional[LocalDispatcher] = None  # None: a LocalDispatcher over all experts
    stats: Optional[ExpertLoadStats] = None
    offload: Any = None  # the OffloadManager of an offloading store (moe_infer.offload), shared by the layers
    trace: Optional[RoutingTraceRecorder] = None  # records the router's choice per token (routing.trace)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP run on every token (Qwen2-MoE: scaled by sigmoid(gate(x)))."""

    def __init__(self, hidden_size: int, intermediate_size: int, gated: bool, dtype: torch.dtype,
                 tp: ShardGroup = SINGLE, quant: Optional[QuantSpec] = None) -> None:
        super().__init__()
        local = tp.split(intermediate_size, "shared_expert_intermediate_size")
        self.gate_up_proj = make_linear(hidden_size, 2 * local, False, dtype, quant)
        self.down_proj = RowParallelLinear(local, hidden_size, False, dtype, tp, quant)
        self.gate = nn.Linear(hidden_size, 1, bias=False, dtype=dtype) if gated else None

    def forward(self, x_TD: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce=False: this rank's partial sum (the caller all-reduces it with the routed experts')."""
        gate_TF, up_TF = linear(x_TD, self.gate_up_proj.weight).chunk(2, dim=-1)
        act_TF = F.silu(gate_TF) * up_TF
        y_TD = self.down_proj(act_TF) if reduce else linear(act_TF, self.down_proj.weight)
        if self.gate is not None:
            y_TD = torch.sigmoid(linear(x_TD, self.gate.weight)) * y_TD
        return y_TD


class MoELayer(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        intermediate_size: int,
        spec: RoutingSpec,
        backends: MoEBackends,
        dtype: torch.dtype,
        shared_intermediate_size: int = 0,
        shared_gated: bool = False,
        tp: ShardGroup = SINGLE,
        moe_tp: ShardGroup = SINGLE,
        stage: ShardGroup = SINGLE,
        dp: ShardGroup = SINGLE,
        router_dtype: Optional[torch.dtype] = None,
        quant: Optional[QuantSpec] = None,
        router_bias: bool = False,
        expert_bias: bool = False,
        expert_act: ExpertAct = SILU,
    ) -> None:
        """router_dtype: the router's weight and logits in this dtype (DeepSeek: float32), else the model's. quant:
        the experts' and the shared expert's weights stored quantized (moe_infer/quant.py; the router never is).
        router_bias, expert_bias, expert_act: GPT-OSS's router bias, expert biases and clamped SwiGLU
        (moe_infer/experts/activation.py); the fused kernels apply them (bf16, int4, mxfp4 experts), other backends
        and formats run the per-call path; an offloading store moves the biases with their experts."""
        super().__init__()
        self.expert_act, self.expert_bias = expert_act, expert_bias
        self.layer_idx, self.spec, self.backends = layer_idx, spec, backends
        self.tp, self.moe_tp, self.stage, self.dp = tp, moe_tp, stage, dp
        intermediate_size = moe_tp.split(intermediate_size, "moe_intermediate_size")
        self.dispatcher = (backends.dispatcher or LocalDispatcher(spec.num_experts)).for_layer(layer_idx)
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=router_bias, dtype=router_dtype or dtype)
        if spec.has_score_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.store = EXPERT_STORES.get(backends.store)(
            self.dispatcher.num_local_experts, hidden_size, intermediate_size, dtype, manager=backends.offload,
            expert_ids=getattr(self.dispatcher, "local_expert_ids", None), router=self.route,
            num_experts=spec.num_experts, quant=quant,
            **({"bias": True} if expert_bias else {}),
            **({} if backends.store == "resident" else {"expert_act": expert_act, "down_bias": moe_tp.rank == 0}),
        )
        self.shared_expert = (
            SharedExpert(hidden_size, shared_intermediate_size, shared_gated, dtype, tp, quant)
            if shared_intermediate_size else None
        )
        self._select = ROUTING_BACKENDS.get(backends.routing)
        self._policy = CAPACITY_POLICIES.get(backends.policy)
        self._experts = EXPERT_BACKENDS.get(backends.experts)

    def _run_experts(self, x_RD: torch.Tensor, meta) -> torch.Tensor:
        w13_E2FD, w2_EDF = self.store.weights()
        extras = self._extras()
        if extras is None:
            return self._experts(x_RD, meta, w13_E2FD, w2_EDF)
        return self._experts(x_RD, meta, w13_E2FD, w2_EDF, extras)

    def _extras(self) -> Optional[ExpertExtras]:
        """The activation and biases of this layer's experts, None for plain SwiGLU without biases. Under moe_tp
        each rank sums a part of the down projection: the down bias is added on rank 0 of the axis only."""
        if not self.expert_bias and self.expert_act == SILU:
            return None
        b13_E2F, b2_ED = self.store.biases() if self.expert_bias else (None, None)
        return ExpertExtras(self.expert_act, b13_E2F, b2_ED if self.moe_tp.rank == 0 else None)

    @property
    def can_fuse_experts(self) -> bool:
        """Whether the experts backend's fused path (`fused_experts`) can run this layer: SwiGLU experts unquantized,
        fp8 (W8A8) or int4 / mxfp4 (W4A16); experts with biases or GPT-OSS's clamped SwiGLU unquantized, int4 or
        mxfp4 (the kernels' epilogues apply them); else the per-call path of the backend."""
        quant = getattr(self.store.weights()[0], "quant", None) if self.store.is_resident else None
        fmt = getattr(quant, "fmt", None)
        if self._extras() is not None:
            return fmt in getattr(self._experts, "fused_extras_formats", ())
        return quant is None or fmt in FUSED_FORMATS

    def route(self, x_TD: torch.Tensor) -> tuple:
        """(logits_TE, topk_weights_TK, topk_ids_TK): this layer's router (also the offload pre-gate)."""
        w_ED = self.gate.weight
        logits_TE = linear(x_TD if x_TD.dtype == w_ED.dtype else x_TD.to(w_ED.dtype), w_ED, self.gate.bias)
        topk_weights_TK, topk_ids_TK = self._select(logits_TE, self.spec, self.e_score_correction_bias)
        return logits_TE, topk_weights_TK, topk_ids_TK

    def _offloaded_experts(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """The experts through an offloading store: fetch right before they run, compute on slot ids."""
        fetched = self.store.fetch(x_TD, ids_TK)
        compute = partial(slot_experts, self._experts, act=self.expert_act, down_bias=self.moe_tp.rank == 0)
        d = self.dispatcher
        if type(d) is LocalDispatcher:  # the rows fetch saw: slot ids looked up on the host
            return fetched.run_local(x_TD, weights_TK, compute)
        return d.forward_experts(x_TD, ids_TK, weights_TK, self._run_experts,
                                 fused_fn=lambda x_RD, ids_R1, w_R1: fetched.run(x_RD, ids_R1, w_R1, compute))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.dp.communicates:
            return self._forward_dp(x_TD)
        logits_TE, topk_weights_TK, topk_ids_TK = self.route(x_TD)
        if self.backends.trace is not None:
            self.backends.trace.record(self.layer_idx, topk_ids_TK, topk_weights_TK, logits_TE)
        kept_ids_TK, kept_weights_TK = self._policy(
            topk_ids_TK, topk_weights_TK, logits_TE=logits_TE, spec=self.spec, **self.backends.policy_kwargs
        )
        stats = self.backends.stats
        if stats is not None:  # counted at the forward's end, with the other layers (routing/stats.py)
            stats.defer(self.layer_idx, topk_ids_TK, kept_ids_TK, valid_tokens())
            if not at_forward_end(stats, stats.flush):
                stats.flush()
        if getattr(self.dispatcher, "returns_partial", False):  # every rank of the stage holds a part of each sum
            return self._reduce_stage(x_TD, kept_ids_TK, kept_weights_TK)
        out_TD = self._routed_experts(x_TD, kept_ids_TK, kept_weights_TK)
        if self.shared_expert is None:
            return self.moe_tp.all_reduce(out_TD)
        if self.tp == self.moe_tp:  # the same ranks: one all-reduce of both partial sums
            return self.tp.all_reduce(out_TD + self.shared_expert(x_TD, reduce=False))
        return self.moe_tp.all_reduce(out_TD) + self.shared_expert(x_TD)

    def _routed_experts(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """The routed experts' output (this rank's partial sum under tensor or expert parallelism)."""
        fused = getattr(self._experts, "fused_experts", None)  # a backend that gathers and combines itself
        if not self.can_fuse_experts:
            fused = None
        if not self.store.is_resident:
            return self._offloaded_experts(x_TD, ids_TK, weights_TK)
        extras = self._extras()
        if extras is not None and fused is not None:  # only a backend that declares it takes the extras
            fused = partial(fused, extras=extras)
        if fused is not None and type(self.dispatcher) is LocalDispatcher:
            return fused(x_TD, ids_TK, weights_TK, *self.store.weights(), self.dispatcher.expert_start)
        # an EP dispatcher runs a fused backend on its received rows as they lie (ids: local slots)
        fused_fn = None if fused is None else (lambda x, ids, w: fused(x, ids, w, *self.store.weights(), 0))
        return self.dispatcher.forward_experts(x_TD, ids_TK, weights_TK, self._run_experts, fused_fn=fused_fn)

    def _reduce_stage(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """The routed experts' partial sums of every rank of the stage (the reduce dispatcher), summed over the
        stage, the shared expert's partial sum in the sum when its tensor-parallel ranks are the stage's. One
        all-reduce; or, for a large step (the dispatcher's `micro_batches`), M contiguous token chunks, each
        chunk's all-reduce started as soon as its experts are done, so that it runs under the next chunk's."""
        merged = self.shared_expert is not None and self.tp.size == self.stage.size
        T, D = x_TD.shape
        M = self.dispatcher.micro_batches(T, D, x_TD.element_size()) if self.store.is_resident else 1
        if M == 1:
            out_TD = self.stage.all_reduce(self._stage_part(x_TD, ids_TK, weights_TK, merged))
        else:
            pending = [self.stage.all_reduce_async(self._stage_part(x_CD, ids_CK, weights_CK, merged))
                       for x_CD, ids_CK, weights_CK in zip(x_TD.tensor_split(M), ids_TK.tensor_split(M),
                                                           weights_TK.tensor_split(M))]
            out_TD = torch.cat([p.wait() for p in pending])
        if self.shared_expert is None or merged:
            return out_TD
        return out_TD + self.shared_expert(x_TD)

    def _stage_part(self, x_CD: torch.Tensor, ids_CK: torch.Tensor, weights_CK: torch.Tensor,
                    merged: bool) -> torch.Tensor:
        """This rank's partial sum of C tokens for the stage all-reduce (the shared expert's part in it if merged)."""
        part_CD = self._routed_experts(x_CD, ids_CK, weights_CK)
        return part_CD + self.shared_expert(x_CD, reduce=False) if merged else part_CD

    # ---- attention data parallelism ---------------------------------------------------------------------------
    def _forward_dp(self, x_TD: torch.Tensor) -> torch.Tensor:
        """This replica's T rows in, their MoE output out; every replica's rows routed and run here (the module
        docstring). Shapes only: the same on every rank of the stage, capturable."""
        if not getattr(self.dispatcher, "returns_partial", False):
            raise RuntimeError("attention data parallelism runs the reduce dispatcher only")
        dp, T = self.dp, x_TD.shape[0]
        x_ND = dp.all_gather_rows(x_TD)  # N = dp * T, replica-major
        logits_NE, topk_weights_NK, topk_ids_NK = self.route(x_ND)
        kept_ids_NK, kept_weights_NK = self._policy(
            topk_ids_NK, topk_weights_NK, logits_TE=logits_NE, spec=self.spec, **self.backends.policy_kwargs)
        stats = self.backends.stats
        if stats is not None:
            stats.defer(self.layer_idx, topk_ids_NK, kept_ids_NK, self._gathered_valid())
            if not at_forward_end(stats, stats.flush):
                stats.flush()
        part_ND = self._routed_experts(x_ND, kept_ids_NK, kept_weights_NK)
        if self.shared_expert is not None:  # its tensor-parallel part of this replica's rows, summed below
            own = slice(dp.rank * T, (dp.rank + 1) * T)
            part_ND[own] += self.shared_expert(x_TD, reduce=False)
        tp = self.tp.size
        Tp = -(-T // tp) * tp  # rows a replica takes in the reduce-scatter: a multiple of tp
        if Tp != T:
            part_ND = torch.nn.functional.pad(part_ND.view(dp.size, T, -1), (0, 0, 0, Tp - T)).view(dp.size * Tp, -1)
        out_CD = self.stage.reduce_scatter_rows(part_ND)  # [Tp / tp, D]: this rank's piece of its replica's rows
        return self.tp.all_gather_rows(out_CD)[:T]

    def _gathered_valid(self):
        """The padding mask of every replica's rows ([dp*T] bool), gathered once per forward and mask (the last
        layer's rows have a mask of their own); None where every row is a real token."""
        valid_T = valid_tokens()
        if valid_T is None:
            return None
        ctx = current_forward_context()
        key = ("dp_valid", id(valid_T))
        hit = ctx.memo.get(key) if ctx is not None else None
        if hit is not None:
            return hit[1]
        valid_N = self.dp.all_gather_rows(valid_T.view(torch.uint8)).view(torch.bool)
        if ctx is not None:
            ctx.memo[key] = (valid_T, valid_N)  # valid_T kept alive: its id stays its own for the forward
        return valid_N
