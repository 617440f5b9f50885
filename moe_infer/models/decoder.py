"""The generic MoE decoder: embeddings -> N x (RMSNorm, attention, RMSNorm, MoE or dense MLP) -> norm.

One class serves every family of `families.py`; the ModelArch switches the differences on. The
forward takes a step's flattened tokens and reads the paged-attention metadata from the forward
context, so it knows nothing of sequences or scheduling.

A `ModelShard` says which part this rank holds: its pipeline stage's layers (the others are
`MissingLayer` placeholders, so parameter names keep the global layer index), the embedding on the
first stage, the final norm and LM head on the last, and the tensor-parallel axes of its layers.
A stage other than the first takes the previous stage's hidden states instead of token ids; a
stage other than the last returns its hidden states un-normed (the residual stream).

Legend: T tokens, D hidden, V vocab, B rows to compute logits for.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from moe_infer.layers.attention import Attention
from moe_infer.layers.forward_context import current_forward_context, fewer_rows
from moe_infer.layers.last_rows import LastRows, last_rows
from moe_infer.layers.mla import MLAttention
from moe_infer.layers.mlp import DenseMLP
from moe_infer.layers.moe import MoEBackends, MoELayer
from moe_infer.layers.norm import RMSNorm
from moe_infer.layers.rotary import RotaryEmbedding
from moe_infer.layers.tensor_parallel import ParallelLMHead, VocabParallelEmbedding
from moe_infer.models.arch import ModelArch
from moe_infer.models.shard import WHOLE, ModelShard
from moe_infer.routing.spec import RoutingSpec


class DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, layer_idx: int, rotary: RotaryEmbedding, backends: MoEBackends, dtype: torch.dtype,
        attn_backend: str = "torch", shard: ModelShard = WHOLE, moe: Optional[bool] = None,
    ) -> None:
        """moe: whether the block's MLP is a MoE layer (None: as the arch says for layer_idx; the MTP layers after
        the decoder's last say it themselves)."""
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        attention = MLAttention if arch.mla is not None else Attention
        self.self_attn = attention(arch, layer_idx, rotary, dtype, attn_backend, shard.tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.is_moe = arch.is_moe_layer(layer_idx) if moe is None else moe
        if self.is_moe:
            spec = RoutingSpec(num_experts=arch.num_experts, top_k=arch.top_k, renormalize=arch.norm_topk_prob,
                               scoring=arch.scoring, num_expert_group=arch.num_expert_group,
                               topk_group=arch.topk_group, routed_scaling_factor=arch.routed_scaling_factor,
                               has_score_bias=arch.has_score_bias)
            self.mlp: nn.Module = MoELayer(
                layer_idx, arch.hidden_size, arch.moe_intermediate_size, spec, backends, dtype,
                shared_intermediate_size=arch.shared_expert_intermediate_size,
                shared_gated=arch.shared_expert_gated, tp=shard.tp, moe_tp=shard.moe_tp,
                stage=shard.stage_axis, dp=shard.dp, router_dtype=torch.float32 if arch.router_fp32 else None,
                quant=arch.quant, router_bias=arch.router_bias, expert_bias=arch.expert_bias,
                expert_act=arch.expert_act,
            )
        else:
            self.mlp = DenseMLP(arch.hidden_size, arch.intermediate_size, dtype, shard.tp, arch.quant)

    def forward(self, h_TD: torch.Tensor, positions_T: torch.Tensor, delta_TD: Optional[torch.Tensor] = None,
                rows: Optional[LastRows] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MLP output): the caller adds the output, fused into the next
        norm (h_TD + delta_TD is the stream this layer reads; delta_TD None: h_TD is). With rows (the last
        layer, moe_infer/layers/last_rows.py): every row's K/V written, both outputs of rows.keep_B only [B, D]."""
        if delta_TD is None:
            x_TD = self.input_layernorm(h_TD)
        else:
            h_TD, x_TD = self.input_layernorm.add_forward(h_TD, delta_TD)
        attn_TD = self.self_attn(x_TD, positions_T, rows)
        if rows is not None:
            h_TD = h_TD.index_select(0, rows.keep_B)
        h_TD, x_TD = self.post_attention_layernorm.add_forward(h_TD, attn_TD)
        if rows is None:
            return h_TD, self.mlp(x_TD)
        with fewer_rows(rows.attn, rows.valid_B):
            return h_TD, self.mlp(x_TD)


class MissingLayer(nn.Module):
    """A decoder layer of another pipeline stage: no parameters, never called."""

    is_moe = False

    def forward(self, *args) -> torch.Tensor:
        raise RuntimeError("a decoder layer of another pipeline stage was called")


class MoEModel(nn.Module):
    """A causal MoE LM over a paged KV cache. Build through `moe_infer.models.load_model`."""

    def __init__(
        self, arch: ModelArch, hf_config: Any, dtype: torch.dtype, backends: Optional[MoEBackends] = None,
        attn_backend: str = "torch", shard: ModelShard = WHOLE,
    ) -> None:
        super().__init__()
        self.arch, self.hf_config, self.dtype, self.shard = arch, hf_config, dtype, shard
        self.kv_cache_dtype = dtype  # or torch.float8_e4m3fn (`set_kv_cache_dtype`)
        self.backends = backends or MoEBackends()
        self.rotary = RotaryEmbedding(hf_config, arch.rope_dim)
        self.local_layers = shard.layer_range(arch.num_layers)
        V, D, tp = arch.vocab_size, arch.hidden_size, shard.tp
        self.embed_tokens = VocabParallelEmbedding(V, D, dtype, tp) if shard.is_first_stage else None
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, self.rotary, self.backends, dtype, attn_backend, shard)
            if i in self.local_layers else MissingLayer() for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(D, arch.rms_norm_eps, dtype) if shard.is_last_stage else None
        tied = self.embed_tokens if arch.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(V, D, dtype, tp, tied) if shard.is_last_stage else None
        self.mtp: Optional[nn.ModuleList] = None  # DeepSeek-V3's MTP layers, where built (moe_infer/models/mtp.py)
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                hidden_TD: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids_T, positions_T [T] (int) -> hidden states [T, D] in the model dtype: final-normed on
        the last stage, the residual stream elsewhere. hidden_TD: the previous stage's output (stages > 0)."""
        h_TD, delta_TD = self.forward_head(input_ids_T, positions_T, hidden_TD, num_layers=0)
        return self.forward_tail(h_TD, delta_TD, positions_T, first_layer=0)

    def can_run_last_rows(self) -> bool:
        """Whether this rank can run its last layer on each sequence's last row only: it holds the model's
        last layer (the last pipeline stage) and that layer's attention backend has an attend-only part."""
        last = self.local_layers[-1] if len(self.local_layers) else None
        return (self.shard.is_last_stage and last == self.arch.num_layers - 1
                and self.layers[last].self_attn.supports_last_rows)

    def _last_rows(self) -> Optional[LastRows]:
        """The last layer's rows when the forward context asks for them and the step has a sequence of more
        than one row (decode steps: None, every row is a last row)."""
        ctx = current_forward_context()
        if ctx is None or not ctx.last_rows or ctx.attn is None or ctx.attn.max_query_len <= 1:
            return None
        if not self.can_run_last_rows():
            raise RuntimeError("forward_context(last_rows=True) on a model part that cannot run it "
                               "(check can_run_last_rows first)")
        return last_rows(ctx.attn, ctx.valid_T)

    @torch.no_grad()
    def forward_head(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor,
                     hidden_TD: Optional[torch.Tensor] = None, num_layers: int = 1):
        """The start of `forward`: the embedding (or the previous stage's hidden_TD) and this stage's first
        num_layers layers -> (residual stream h_TD, the last layer's output delta_TD not yet added, or None).
        A CUDA graph of a prefill step replays this piece apart, so that the GPU runs it while the host still
        launches the rest (moe_infer/engine/extend_graph.py)."""
        if input_ids_T.dim() != 1 or input_ids_T.shape != positions_T.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids_T.shape)} and positions {tuple(positions_T.shape)} must be equal 1-D"
            )
        if self.embed_tokens is not None:
            h_TD = self.embed_tokens(input_ids_T)
        elif hidden_TD is None:
            raise ValueError("a pipeline stage other than the first needs the previous stage's hidden states")
        else:
            h_TD = hidden_TD
        delta_TD = None
        for i in self.local_layers[:num_layers]:  # each residual add runs fused into the norm after it
            h_TD, delta_TD = self.layers[i](h_TD, positions_T, delta_TD)
        return h_TD, delta_TD

    @torch.no_grad()
    def forward_tail(self, h_TD: torch.Tensor, delta_TD: Optional[torch.Tensor], positions_T: torch.Tensor,
                     first_layer: int = 1) -> torch.Tensor:
        """The rest of `forward` after `forward_head(..., num_layers=first_layer)`: this stage's layers from
        first_layer on, then the final norm (last stage) -> hidden states [T, D]; [B, D], each sequence's last
        row, where the forward context asks for `last_rows` (moe_infer/layers/last_rows.py)."""
        layers = self.local_layers[first_layer:]
        rows = self._last_rows() if layers else None
        for i in layers:
            h_TD, delta_TD = self.layers[i](h_TD, positions_T, delta_TD, rows if i == layers[-1] else None)
        if delta_TD is None:
            return h_TD if self.norm is None else self.norm(h_TD)
        if self.norm is None:
            return h_TD + delta_TD
        return self.norm.add_forward(h_TD, delta_TD)[1]

    @torch.no_grad()
    def compute_logits(self, hidden_BD: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [B, D] -> float32 logits [B, V] (last pipeline stage only); upcast=False: in the model dtype
        (for a greedy argmax, which the cast cannot change)."""
        logits_BV = self.lm_head(hidden_BD)
        return logits_BV.float() if upcast else logits_BV

    @property
    def num_kv_heads(self) -> int:
        """KV heads held on this rank (tensor parallel: its share)."""
        return self.layers[self.local_layers[0]].self_attn.num_kv_heads

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> List[Tuple[Tuple[int, ...], ...]]:
        """Per layer of this stage, the shapes of its cache tensors: (K, V) [Nb, S, Hkv, d] each (Hkv: this rank's
        KV heads), or MLA's one latent cache [Nb, S, 1, kv_lora_rank + qk_rope_head_dim]."""
        return [self.layers[i].self_attn.cache_shapes(num_blocks, block_size) for i in self.local_layers]

    def set_kv_cache_dtype(self, kv_dtype: torch.dtype) -> None:
        """The dtype of the KV caches: the model's, or float8_e4m3fn (per-head K/V, or MLA's latent rows)."""
        if kv_dtype not in (self.dtype, torch.float8_e4m3fn):
            raise ValueError(f"KV cache dtype {kv_dtype}: the model's {self.dtype} or torch.float8_e4m3fn")
        self.kv_cache_dtype = kv_dtype

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device,
                          fill: float = 0.0) -> List[Tuple[torch.Tensor, ...]]:
        """The cache tensors of `kv_cache_shapes`, in the KV cache dtype, filled with `fill`."""
        return [tuple(torch.full(shape, fill, dtype=self.kv_cache_dtype, device=device) for shape in shapes)
                for shapes in self.kv_cache_shapes(num_blocks, block_size)]

    def bind_kv_cache(self, kv_caches: Sequence[Tuple[torch.Tensor, ...]]) -> None:
        """One tuple of cache tensors per layer of this stage, shaped as `kv_cache_shapes` says (any block count
        and block size, the same for all), in the model dtype."""
        if len(kv_caches) != len(self.local_layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.local_layers)} layers")
        for n, (i, kv) in enumerate(zip(self.local_layers, kv_caches)):
            kv = tuple(kv)
            if not kv or kv[0].dim() != 4:
                raise ValueError(f"layer {n}: a KV cache is a tuple of [num_blocks, block_size, heads, dim] tensors")
            want = self.layers[i].self_attn.cache_shapes(kv[0].shape[0], kv[0].shape[1])
            got = tuple(tuple(t.shape) for t in kv)
            if got != want:
                raise ValueError(f"layer {n}: KV cache tensors {list(got)}, this layer needs {list(want)}")
            if any(t.dtype != self.kv_cache_dtype for t in kv):
                raise ValueError(f"layer {n}: KV cache dtype {[t.dtype for t in kv]}, expected {self.kv_cache_dtype}")
        for i, kv in zip(self.local_layers, kv_caches):
            self.layers[i].self_attn.kv_cache = tuple(kv)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of this rank's cache (its layers, its KV heads or latent rows) for one block of block_size tokens."""
        itemsize = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return sum(math.prod(shape) for shapes in self.kv_cache_shapes(1, block_size) for shape in shapes) * itemsize

    def moe_layers(self) -> List[MoELayer]:
        return [layer.mlp for layer in self.layers if layer.is_moe]
