"""CUDA graphs of each layer's attention part, for decode steps whose MoE layers must run eagerly.

With an offloading expert store (`offload=cpu|nvme`) each MoE layer syncs with the host to decide
which experts to move, so a decode step cannot be one graph (engine/cuda_graph.py). Its attention
part can: per layer, the residual add and input norm, attention (QKV, RoPE and the K/V write,
paged attention, output projection) and the post-attention norm have the same kernels every decode
step. Like vLLM's piecewise graphs, the step is cut at the MoE layers: one graph per layer replays
that part over static buffers, the MoE layer (router, offload decisions, experts) runs eagerly on
its output, and its result is copied into the static input of the next layer's graph. With one
stream an offloaded step's host time adds to the link's; measured on H100s (docs/offload.md), one
Qwen3-30B-A3B stream at 99 % cache hits went from 6.4-7.0 to 8.9-11.2 tok/s, one Mixtral stream
0-8 % faster (its copies set the step time).

The static buffers, buckets and padding are DecodeGraphs' (batch padded to a capture size, the
context to a power of two of blocks); a graph per (padded batch, context bucket, layer), captured
the first time its key is seen, for at most MAX_BUCKETS (batch, context) pairs. Padding rows run through the attention graphs only: the MoE layers
see the step's rows [:B] (an offloading store would otherwise fetch experts for them). A capture
that fails switches the graphs off (logged once); the layer runs eagerly, the step goes on.

capture=False runs the same static-buffer pieces eagerly: the padding and the hand-over between
pieces are then testable without a GPU.

Legend: B sequences of the step (one token each), Bp padded batch, Mp blocks of the context bucket,
D hidden.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch

from moe_infer.engine.cuda_graph import DecodeGraphs, capture_graph, replay_graph
from moe_infer.layers.forward_context import AttentionMetadata, forward_context

logger = logging.getLogger(__name__)

Piece = Tuple[torch.Tensor, torch.Tensor]  # (residual stream h_BD, normed input of the MLP x_BD), static
MAX_BUCKETS = 32  # (padded batch, context bucket) pairs with graphs: each holds one graph per layer


class LayerGraphs:
    def __init__(self, model, max_batch: int, max_blocks: int, block_size: int, device: torch.device,
                 capture: bool = True, max_buckets: int = MAX_BUCKETS) -> None:
        self.model, self.capture, self.max_buckets = model, capture, max_buckets
        self.buckets: set = set()  # the (Bp, Mp) pairs that have (or are getting) graphs
        self.full_logged = False
        self.steps = DecodeGraphs(model, max_batch, max_blocks, block_size, device, capture=capture)
        Bmax, D = self.steps.max_batch, model.arch.hidden_size
        self.delta_BD = torch.zeros(Bmax, D, dtype=model.dtype, device=device)  # the previous MLP's output
        self.graphs: Dict[Tuple[int, int, int], Tuple[List[torch.cuda.CUDAGraph], Piece]] = {}
        self.pool = self.steps.pool
        self.disabled: Optional[str] = None
        self.runs = 0  # layer pieces replayed (or run over the static buffers with capture=False)

    def can_run(self, sizes) -> bool:
        """A pure decode step that fits the static buffers (sizes: the step's `step_inputs.Sizes`)."""
        return self.disabled is None and self.steps.can_run(sizes)

    def run(self, input_ids_T: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model forward of a decode step -> final hidden states [B, D]."""
        model, steps = self.model, self.steps
        B = input_ids_T.shape[0]
        Bp, Mp = steps._bucket(B, meta)
        steps._fill(input_ids_T, meta, Bp)
        static = steps._meta(Bp, Mp)
        graphs = self.capture and self.disabled is None and self._may_capture((Bp, Mp))
        h_BD: Optional[torch.Tensor] = None
        delta_BD: Optional[torch.Tensor] = None
        for i in model.local_layers:
            layer = model.layers[i]
            piece = partial(self._piece, layer, h_BD, static, Bp)
            out = None
            if graphs and self.disabled is None:
                out = replay_graph(self, (Bp, Mp, i), lambda: self._capture(piece, Bp), f"layer {i} at batch {Bp}")
            if out is None:  # capture=False, the graphs were switched off, or the bucket budget is spent
                out = piece()
                self.runs += self.capture is False
            h_BD, x_BD = out
            with forward_context(static, valid_T=None):  # the MLP sees the step's own rows only
                delta_BD = layer.mlp(x_BD[:B])
            self.delta_BD[:B].copy_(delta_BD)
        if model.norm is None:
            return h_BD[:B] + delta_BD
        return model.norm.add_forward(h_BD[:B], delta_BD)[1]

    def _may_capture(self, bucket: Tuple[int, int]) -> bool:
        """A bucket has graphs, or may get them: at most max_buckets (later new ones run eagerly)."""
        if bucket in self.buckets or len(self.buckets) < self.max_buckets:
            self.buckets.add(bucket)
            return True
        if not self.full_logged:
            self.full_logged = True
            logger.info("layer graphs for %d (batch, context) buckets captured (the limit): decode steps of new "
                        "buckets run eagerly", self.max_buckets)
        return False

    def _piece(self, layer, h_BD: Optional[torch.Tensor], static: AttentionMetadata, Bp: int) -> Piece:
        """One layer up to its MLP, over the static buffers: (residual stream, normed MLP input). h_BD:
        the previous piece's residual stream (None: the first layer, which embeds the tokens)."""
        steps = self.steps
        with forward_context(static, valid_T=steps.valid_B[:Bp]):
            if h_BD is None:
                h_BD = self.model.embed_tokens(steps.input_ids_B[:Bp])
                x_BD = layer.input_layernorm(h_BD)
            else:
                h_BD, x_BD = layer.input_layernorm.add_forward(h_BD, self.delta_BD[:Bp])
            attn_BD = layer.self_attn(x_BD, steps.positions_B[:Bp])
            return layer.post_attention_layernorm.add_forward(h_BD, attn_BD)

    def _capture(self, piece, Bp: int) -> Tuple[List[torch.cuda.CUDAGraph], Piece]:
        graph, out = capture_graph(piece, self.steps.valid_B[:Bp], self.pool)
        return [graph], out
