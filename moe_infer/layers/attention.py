"""Decoder self-attention on a paged KV cache: fused qkv projection (optional bias), q/k norm
(per head: Qwen3-MoE; over the whole projection: OLMoE), clip_qkv (OLMoE), rotary, GQA, a sliding window per
layer (Mixtral; GPT-OSS's alternate layers), attention sinks (GPT-OSS: `sinks`, one logit a query head).

Tensor parallel over `tp` (a `ShardGroup`): each rank holds H / tp query heads (column-parallel
q/k/v) and the KV heads they read: Hkv / tp of them, or, when there are fewer KV heads than ranks,
the one its query heads share (replicated on tp / Hkv ranks). o_proj is row-parallel (one
all-reduce). OLMoE's whole-projection q/k norm sums the squares over the ranks (one small
all-reduce each). The KV cache of a rank holds its own KV heads.

The K/V write + paged attention is one call of a backend from ATTENTION_BACKENDS ("torch": the
float32 reference of paged_attention.py; "sdpa": the same gather with torch's SDPA). A backend also in
ROPE_FUSED_BACKENDS ("triton") instead gets q, k, v unrotated: one kernel rotates q and k and writes K/V
(from the rotary's cos/sin table), then its attend-only function reads the cache (or, for a decode step, one
kernel does all of it: `moe_infer.kernels.rope_decode_attention`). That kernel also applies
the q/k norm (the RMSNorm modules keep the weights; only their launches go), per head or over the whole
projection, at tp = 1 for the latter and without clip_qkv (under tp > 1 ShardedRMSNorm sums over the
ranks; OLMoE's clip_qkv clamps between the norm and the rotary): those stay on the modules. The step's
attention metadata comes from `get_forward_context().attn`; the layer's (k_cache, v_cache) is
bound once by the model runner through `MoEModel.bind_kv_cache`.

Legend: T tokens, D hidden, H query heads, Hkv KV heads, d head_dim (the layer's: local heads).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from moe_infer.layers.forward_context import get_forward_context
from moe_infer.layers.last_rows import LastRows
from moe_infer.layers.linear import linear
from moe_infer.layers.norm import RMSNorm, ShardedRMSNorm
from moe_infer.quant import make_linear
from moe_infer.layers.paged_attention import (
    ATTENTION_BACKENDS, KV_FP8, ROPE_FUSED_BACKENDS, RopeFusedAttention, attend_cached, store_kv,
)
from moe_infer.layers.rotary import RotaryEmbedding
from moe_infer.layers.tensor_parallel import SINGLE, RowParallelLinear, ShardGroup
from moe_infer.models.arch import ModelArch


@dataclass(frozen=True)
class HeadSplit:
    """This rank's heads: query heads [q_start, q_start + num_heads), KV heads [kv_start, kv_start + num_kv_heads)."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int
    kv_replicas: int  # ranks holding each of these KV heads (1 when Hkv >= tp)


def head_split(num_heads: int, num_kv_heads: int, shard: ShardGroup) -> HeadSplit:
    tp, r = shard.size, shard.rank
    H = shard.split(num_heads, "num_attention_heads")
    if num_kv_heads >= tp:
        Hkv = shard.split(num_kv_heads, "num_key_value_heads")
        return HeadSplit(H, Hkv, r * H, r * Hkv, 1)
    if tp % num_kv_heads:
        raise ValueError(f"num_key_value_heads={num_kv_heads} < tp={tp} must divide tp (KV heads are replicated)")
    return HeadSplit(H, 1, r * H, r * num_kv_heads // tp, tp // num_kv_heads)


def _can_fuse_norm(arch: ModelArch, tp: ShardGroup) -> bool:
    """The q/k norm comes right before the rotary and needs no other rank: per head, or over the whole
    projection at tp = 1; never with clip_qkv (clamped between the norm and the rotary)."""
    return arch.clip_qkv is None and (arch.qk_norm == "head" or (arch.qk_norm == "proj" and tp.size == 1))


class Attention(nn.Module):
    def __init__(
        self, arch: ModelArch, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype, backend: str = "torch",
        tp: ShardGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.backend, self._attend = backend, ATTENTION_BACKENDS.get(backend)
        self._rope_fused = ROPE_FUSED_BACKENDS.get(backend) if backend in ROPE_FUSED_BACKENDS else None
        self.layer_idx = layer_idx
        self.heads = heads = head_split(arch.num_heads, arch.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = heads.num_heads * arch.head_dim, heads.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim ** -0.5
        self.clip_qkv = arch.clip_qkv
        self.sliding_window = arch.sliding_windows[layer_idx]
        self.qkv_proj = make_linear(arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias, dtype, arch.quant)
        self.o_proj = RowParallelLinear(self.q_size, arch.hidden_size, arch.o_bias, dtype, tp, arch.quant)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype)
        elif arch.qk_norm == "proj" and tp.size == 1:
            self.q_norm = RMSNorm(self.q_size, arch.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.kv_size, arch.rms_norm_eps, dtype)
        elif arch.qk_norm == "proj":
            self.q_norm = ShardedRMSNorm(self.q_size, arch.q_size, arch.rms_norm_eps, dtype, tp)
            self.k_norm = ShardedRMSNorm(self.kv_size, arch.kv_size, arch.rms_norm_eps, dtype, tp, heads.kv_replicas)
        elif arch.qk_norm != "none":
            raise ValueError(f"qk_norm must be none, head or proj, got {arch.qk_norm!r}")
        # the q/k norm the fused kernel applies in place of the modules ("none": _qkv runs them, if any)
        self.fused_norm = arch.qk_norm if self._rope_fused is not None and _can_fuse_norm(arch, tp) else "none"
        # whether this layer's decode steps (one query token a sequence) run the fused backend's one-call decode
        fused = self._rope_fused
        self.decode_in_one_call = (fused is not None and fused.decode is not None
                                   and fused.decode_supports(self.head_dim, self.fused_norm, 1))
        self.rotary = rotary
        self.kv_cache: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        # GPT-OSS's attention sinks: a logit per (this rank's) query head in the softmax's denominator, float32
        self.sinks = (nn.Parameter(torch.zeros(heads.num_heads, dtype=torch.float32), requires_grad=False)
                      if arch.attn_sinks else None)
        self._sinks = {} if self.sinks is None else {"sinks_H": self.sinks}  # the attention calls' keyword
        # an fp8 KV cache holds k / k_scale[h], v / v_scale[h] (1.0: vLLM's default); it runs the unfused path
        self.register_buffer("k_scale", torch.ones(self.num_kv_heads, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(self.num_kv_heads, dtype=torch.float32), persistent=False)

    def cache_shapes(self, num_blocks: int, block_size: int) -> Tuple[Tuple[int, ...], ...]:
        """This layer's cache tensors: K and V, [Nb, S, Hkv, d] each (this rank's KV heads)."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return (shape, shape)

    @property
    def supports_last_rows(self) -> bool:
        """Whether `forward` can take `rows`: the backend's attend-only part is at hand."""
        return self._rope_fused is not None or hasattr(self._attend, "attend")

    def _fused(self) -> Optional[RopeFusedAttention]:
        """The rope-fused backend, unless the cache is fp8 (its kernels write and read 16-bit caches only)."""
        return self._rope_fused if self.kv_cache is None or self.kv_cache[0].dtype != KV_FP8 else None

    def _kv_scales(self) -> Dict[str, Any]:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale) if self.kv_cache[0].dtype == KV_FP8 else {}

    def _qkv(self, x_TD: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = x_TD.shape[0]
        qkv = linear(x_TD, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        in_kernel = self.fused_norm != "none" and self._fused() is not None
        norm = "none" if in_kernel else self.qk_norm  # the norm run here, not in the kernel
        if norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q_THd = q.reshape(T, self.num_heads, self.head_dim)
        k_THd = k.reshape(T, self.num_kv_heads, self.head_dim)
        v_THd = v.reshape(T, self.num_kv_heads, self.head_dim)
        if norm == "head":
            q_THd, k_THd = self.q_norm(q_THd), self.k_norm(k_THd)
        return q_THd, k_THd, v_THd

    def _fused_norm_args(self) -> Dict[str, Any]:
        """The q/k norm keyword arguments of `rope_store_kv` (none when the kernel applies no norm)."""
        if self.fused_norm == "none":
            return {}
        return dict(q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight, norm_eps=self.q_norm.eps,
                    norm_mode=self.fused_norm)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, rows: Optional[LastRows] = None) -> torch.Tensor:
        """[T, D] -> [T, D]; with rows (the last layer of a step, moe_infer/layers/last_rows.py): every row's K/V
        written, the output of rows.keep_B only -> [B, D]."""
        attn = get_forward_context().attn
        if attn is None:
            raise RuntimeError("attention needs AttentionMetadata in the forward context, got None")
        if self.kv_cache is None:
            raise RuntimeError(f"layer {self.layer_idx}: no KV cache bound; call model.bind_kv_cache(...) first")
        q_THd, k_THd, v_THd = self._qkv(x_TD)
        k_cache, v_cache = self.kv_cache
        fused = self._fused()
        if rows is not None:
            return self._last_rows(q_THd, k_THd, v_THd, positions_T, attn, rows)
        if fused is not None:
            cos_sin_Pd = self.rotary.cos_sin_cache(q_THd.device, q_THd.dtype)
            if self.decode_in_one_call and attn.max_query_len <= 1:
                o_THd = fused.decode(q_THd, k_THd, v_THd, positions_T, cos_sin_Pd, k_cache, v_cache,
                                     attn.slot_mapping_T, attn.block_tables_BM, attn.seq_lens_B,
                                     attn.query_start_loc_B1, self.scale, attn.max_seq_len, self.sliding_window,
                                     **self._fused_norm_args(), **self._sinks)
                return self.o_proj(o_THd.reshape(x_TD.shape[0], self.q_size))
            q_THd = fused.rope_store_kv(q_THd, k_THd, v_THd, positions_T, cos_sin_Pd, k_cache, v_cache,
                                        attn.slot_mapping_T, **self._fused_norm_args())
            o_THd = attend_cached(fused.attend, q_THd, k_cache, v_cache, attn, positions_T, self.scale,
                                  self.sliding_window, self.sinks)
        else:
            q_THd, k_THd = self.rotary(positions_T, q_THd, k_THd)
            o_THd = self._attend(q_THd, k_THd, v_THd, k_cache, v_cache, attn, positions_T, self.scale,
                                 self.sliding_window, **self._sinks, **self._kv_scales())
        return self.o_proj(o_THd.reshape(x_TD.shape[0], self.q_size))

    def _last_rows(self, q_THd: torch.Tensor, k_THd: torch.Tensor, v_THd: torch.Tensor, positions_T: torch.Tensor,
                   attn, rows: LastRows) -> torch.Tensor:
        """Every row's K/V rotated and written, then only rows.keep_B attended (one query a sequence) -> [B, D]."""
        k_cache, v_cache = self.kv_cache
        fused = self._fused()
        if fused is not None:
            cos_sin_Pd = self.rotary.cos_sin_cache(q_THd.device, q_THd.dtype)
            q_THd = fused.rope_store_kv(q_THd, k_THd, v_THd, positions_T, cos_sin_Pd, k_cache, v_cache,
                                        attn.slot_mapping_T, **self._fused_norm_args())
            attend = fused.attend
        else:
            q_THd, k_THd = self.rotary(positions_T, q_THd, k_THd)
            store_kv(k_THd, v_THd, k_cache, v_cache, attn.slot_mapping_T, **self._kv_scales())
            attend = self._attend.attend
        q_BHd = q_THd.index_select(0, rows.keep_B)
        o_BHd = attend_cached(attend, q_BHd, k_cache, v_cache, rows.attn, rows.attn.positions_T, self.scale,
                              self.sliding_window, self.sinks, **self._kv_scales())
        return self.o_proj(o_BHd.reshape(q_BHd.shape[0], self.q_size))
