"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) over a paged latent KV cache.

A token's keys and values are not cached per head. kv_a_proj_with_mqa compresses the token to a latent c_kv of
kv_lora_rank (512) values, RMS-normed, and one rotary key k_rot of qk_rope_head_dim (64) values shared by every
head; the cache holds that row, [c_kv | k_rot] (576 values a token a layer, one "head" of the block table's
cache), instead of H x (192 + 128) per-head K/V values (71x fewer for DeepSeek-V3's 128 heads).

Attention runs in the weight-absorbed form for every step (the reference backend, "torch"): kv_b_proj's rows for
head h are W_UK[h] [nope, c] (keys) and W_UV[h] [v, c] (values), so

    score(t, j) = q_nope[t, h] . (W_UK[h] c_j) + q_rot[t, h] . k_rot_j
                = [q_nope[t, h] W_UK[h] | q_rot[t, h]] . [c_j | k_rot_j]
    out[t, h]   = W_UV[h] sum_j p(t, j) c_j

which is multi-query attention of H queries of 576 values over the cached rows themselves, the values being the
first kv_lora_rank entries of each row (a view of the same cache), read in place through the block tables: by the
paged reference attention ("torch", the absorbed products in float32) or the Triton kernel ("triton", the CUDA
default, moe_infer/kernels/mla_attention.py; the products in the model dtype). A backend may also attend steps with
prompt chunks in the up-projected form (`prompt`: per-head keys and values from the latent rows, then the paged MHA
kernel; "triton" does, where the step's tokens are a large share of its context: `_takes_up_projection`), which
measured 6-16x faster than the absorbed kernel for prompts.

Rotary: the checkpoint's rotary pairs are interleaved ((x0, x1), (x2, x3), ...: DeepSeek's `rope_interleave`,
and V2 always); they are gathered to [x0, x2, ... | x1, x3, ...] first, then turned as everywhere else (rotate-half).
Queries and keys get the same reordering, so every score is that of the interleaved rotation.

Tensor parallel over `tp`: each rank holds H / tp heads (rows of q_proj / q_b_proj and kv_b_proj, columns of
o_proj, one all-reduce); the compression (q_a_proj, kv_a_proj_with_mqa, their norms) and the latent cache are
replicated, as in vLLM and SGLang.

Legend: T tokens, D hidden, H heads (this rank's), n qk_nope_head_dim, r qk_rope_head_dim, c kv_lora_rank,
C = c + r cache row, v v_head_dim, Q q_lora_rank, Nb blocks, S block size.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional, Tuple

import torch
from torch import nn

from moe_infer.layers.forward_context import AttentionMetadata, get_forward_context
from moe_infer.layers.last_rows import LastRows
from moe_infer.layers.linear import linear
from moe_infer.layers.norm import RMSNorm
from moe_infer.layers.paged_attention import KV_FP8, paged_attention_ref, quantize_kv, store_rows
from moe_infer.quant import dequantized, make_linear
from moe_infer.layers.rotary import RotaryEmbedding
from moe_infer.layers.tensor_parallel import SINGLE, RowParallelLinear, ShardGroup
from moe_infer.registry import Registry

if TYPE_CHECKING:  # a layer takes the parsed arch; it never imports the models package at run time
    from moe_infer.models.arch import ModelArch

logger = logging.getLogger(__name__)

LORA_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm keep the RMSNorm default, not rms_norm_eps
# A step with prompt chunks attends up-projected where its tokens are >= 1/8 of the rows its block tables span: a
# fresh prompt (tokens ~ rows) does; a few prompt rows beside long decode contexts keep the absorbed kernel, whose
# cost grows with queries x keys, not with the context rows up-projected (benchmarks/deepseek_v3.py)
UP_PROJECT_SHARE = 8

# An MLA backend attends H absorbed queries [T, H, C] over the latent cache [Nb, S, 1, C] (values: its first c
# entries) -> [T, H, c]: (q_THC, cache_NbS1C, kv_lora_rank, attn, positions_T, scale), and kv_scale=[1] float32 for
# an fp8 (e4m3) cache, which holds rows / kv_scale (its `prompt`, where it has one, takes kv_scale too).
MLAAttendFn = Callable[[torch.Tensor, torch.Tensor, int, AttentionMetadata, torch.Tensor, float], torch.Tensor]
MLA_BACKENDS: Registry[MLAAttendFn] = Registry("MLA attention backend")


@MLA_BACKENDS.register("torch")
def mla_attend_torch(q_THC: torch.Tensor, cache_NbS1C: torch.Tensor, kv_lora_rank: int, attn: AttentionMetadata,
                     positions_T: torch.Tensor, scale: float, kv_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The reference: the paged gather attention (float32) with keys = the rows, values = their latent part (an fp8
    cache's rows dequantized, times kv_scale)."""
    return paged_attention_ref(q_THC, cache_NbS1C, cache_NbS1C[..., :kv_lora_rank], attn.block_tables_BM,
                               attn.seq_lens_B, attn.query_start_loc_B1, positions_T, scale, attn.max_query_len,
                               attn.max_seq_len, k_scale=kv_scale, v_scale=kv_scale)


mla_attend_torch.compute_dtype = torch.float32  # the absorbed products around it (None: the model dtype)


_warned: set = set()


def resolve_mla_backend(name: str) -> str:
    """The MLA backend for model.attention_backend=name: the same name where one exists, else the reference
    (logged once per name: no MLA kernel of that name yet)."""
    if name in MLA_BACKENDS:
        return name
    if name not in _warned:
        _warned.add(name)
        logger.info("MLA layers attend through the torch reference: attention backend %r has no MLA kernel", name)
    return "torch"


def deinterleave(x_THr: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ... | x1, x3, ...] (rotary pairs from interleaved to halves)."""
    return torch.cat((x_THr[..., 0::2], x_THr[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention: [T, D] -> [T, D], caching one latent row a token (module docstring)."""

    def __init__(self, arch: "ModelArch", layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype,
                 backend: str = "torch", tp: ShardGroup = SINGLE) -> None:
        super().__init__()
        mla = arch.mla
        if mla is None:
            raise ValueError("MLAttention needs a model with multi-head latent attention (arch.mla)")
        self.layer_idx, self.mla, self.rotary = layer_idx, mla, rotary
        self.backend = resolve_mla_backend(backend)
        self._attend = MLA_BACKENDS.get(self.backend)
        self.compute_dtype = getattr(self._attend, "compute_dtype", None) or dtype
        self.num_heads = tp.split(arch.num_heads, "num_attention_heads")
        self.num_kv_heads, self.head_dim = 1, mla.cache_dim  # the cache row: one "head" of c + r values
        H, D, c, r = self.num_heads, arch.hidden_size, mla.kv_lora_rank, mla.qk_rope_head_dim
        quant = arch.quant  # fp8 block-scaled projections (moe_infer/quant.py)
        if mla.q_lora_rank is None:
            self.q_proj = make_linear(D, H * mla.qk_head_dim, False, dtype, quant)
        else:
            self.q_a_proj = make_linear(D, mla.q_lora_rank, arch.qkv_bias, dtype, quant)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = make_linear(mla.q_lora_rank, H * mla.qk_head_dim, False, dtype, quant)
        self.kv_a_proj_with_mqa = make_linear(D, c + r, arch.qkv_bias, dtype, quant)
        self.kv_a_layernorm = RMSNorm(c, LORA_NORM_EPS, dtype)
        self.kv_b_proj = make_linear(c, H * (mla.qk_nope_head_dim + mla.v_head_dim), False, dtype, quant)
        self.o_proj = RowParallelLinear(H * mla.v_head_dim, D, arch.o_bias, dtype, tp, quant)
        self.kv_cache: Optional[Tuple[torch.Tensor]] = None
        # an fp8 latent cache holds row / kv_scale, one scale for the layer's one latent "head" (1.0, as the per-head
        # K/V scales of `Attention`: vLLM's default)
        self.register_buffer("kv_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self._absorbed: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    supports_last_rows = True  # `forward` takes rows (moe_infer/layers/last_rows.py)
    decode_in_one_call = False

    @property
    def static_launch(self) -> bool:
        """Whether the backend's launches depend on shapes and host ints only (prefill steps then replay as CUDA
        graphs); the reference splits mixed steps on the host."""
        return bool(getattr(self._attend, "static_launch", False))

    def decode_variant(self, batch: int, max_seq_len: int, device: torch.device):
        """What a decode of `batch` sequences over max_seq_len keys compiles differently by (the start-up warm-up's
        key, moe_infer/engine/warmup.py); None where the backend compiles nothing."""
        variant = getattr(self._attend, "decode_variant", None)
        return None if variant is None else variant(batch, self.num_heads, max_seq_len, device)

    def cache_shapes(self, num_blocks: int, block_size: int) -> Tuple[Tuple[int, ...], ...]:
        """The one cache tensor of this layer: [Nb, S, 1, C]."""
        return ((num_blocks, block_size, 1, self.mla.cache_dim),)

    def absorbed(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, n, c], W_UV [H, v, c]) in the backend's compute dtype: views of kv_b_proj's weight where that is
        its dtype, else a converted (an fp8 weight: dequantized) copy made once, after the weights are loaded (as
        vLLM keeps DeepSeek's absorbed kv_b_proj in bf16: 32 MB a layer)."""
        w = self.kv_b_proj.weight
        if w.dtype != self.compute_dtype:
            if self._absorbed is None or self._absorbed[0].device != w.device:
                self._absorbed = (dequantized(w, self.compute_dtype),)
            w = self._absorbed[0]
        w_HXc = w.view(self.num_heads, self.mla.qk_nope_head_dim + self.mla.v_head_dim, -1)
        n = self.mla.qk_nope_head_dim
        return w_HXc[:, :n], w_HXc[:, n:]

    def _takes_up_projection(self, attn: AttentionMetadata, num_tokens: int, block_size: int) -> bool:
        """Whether a step attends in the up-projected form (the backend's `prompt`): a step with prompt chunks
        whose tokens are at least 1/UP_PROJECT_SHARE of the rows its block tables span (the up-projection costs per
        row of context; the absorbed form per query and key). From shapes and host ints only (CUDA graphs)."""
        if getattr(self._attend, "prompt", None) is None or attn.max_query_len <= 1:
            return False
        B, M = attn.block_tables_BM.shape
        return num_tokens * UP_PROJECT_SHARE >= B * M * block_size

    def _query(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return linear(x_TD, self.q_proj.weight)
        q_TQ = self.q_a_layernorm(linear(x_TD, self.q_a_proj.weight, self.q_a_proj.bias))
        return linear(q_TQ, self.q_b_proj.weight)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, rows: Optional[LastRows] = None) -> torch.Tensor:
        """[T, D] -> [T, D]; with rows (the last layer of a step, moe_infer/layers/last_rows.py): every row's latent
        written, the output of rows.keep_B only -> [B, D]."""
        attn = get_forward_context().attn
        if attn is None:
            raise RuntimeError("attention needs AttentionMetadata in the forward context, got None")
        if self.kv_cache is None:
            raise RuntimeError(f"layer {self.layer_idx}: no KV cache bound; call model.bind_kv_cache(...) first")
        mla, T, H = self.mla, x_TD.shape[0], self.num_heads
        n, r, c = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        q_nope_THn, q_rot_THr = self._query(x_TD).view(T, H, n + r).split([n, r], dim=-1)
        ckv_TC = linear(x_TD, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)
        c_Tc, k_rot_T1r = self.kv_a_layernorm(ckv_TC[:, :c]), ckv_TC[:, None, c:]
        if mla.rope_interleave:
            q_rot_THr, k_rot_T1r = deinterleave(q_rot_THr), deinterleave(k_rot_T1r)
        q_rot_THr, k_rot_T1r = self.rotary(positions_T, q_rot_THr, k_rot_T1r)
        (cache_NbS1C,) = self.kv_cache
        row_T1C = torch.cat((c_Tc[:, None], k_rot_T1r), dim=-1)
        fp8 = {}
        if cache_NbS1C.dtype == KV_FP8:  # e4m3 of row / kv_scale, written as bytes (as store_kv does)
            fp8 = dict(kv_scale=self.kv_scale)
            store_rows(quantize_kv(row_T1C, self.kv_scale).view(torch.uint8), cache_NbS1C.view(torch.uint8),
                       attn.slot_mapping_T)
        else:
            store_rows(row_T1C, cache_NbS1C, attn.slot_mapping_T)
        w_uk_Hnc, w_uv_Hvc = self.absorbed()
        cd = self.compute_dtype
        if rows is None and self._takes_up_projection(attn, T, cache_NbS1C.shape[1]):
            o_THv = self._attend.prompt(q_nope_THn.to(cd), q_rot_THr.to(cd), cache_NbS1C, w_uk_Hnc, w_uv_Hvc, attn,
                                        mla.softmax_scale, **fp8)
            return self.o_proj(o_THv.reshape(T, H * mla.v_head_dim).to(x_TD.dtype))
        q_lat_HTc = torch.bmm(q_nope_THn.transpose(0, 1).to(cd), w_uk_Hnc)
        q_THC = torch.cat((q_lat_HTc.transpose(0, 1), q_rot_THr.to(cd)), dim=-1)
        if rows is not None:  # the rows attended: one query a sequence, its own metadata
            q_THC, attn, T = q_THC.index_select(0, rows.keep_B), rows.attn, rows.keep_B.shape[0]
            positions_T = attn.positions_T
        o_lat_THc = self._attend(q_THC, cache_NbS1C, c, attn, positions_T, mla.softmax_scale, **fp8)
        o_HTv = torch.bmm(o_lat_THc.transpose(0, 1).to(cd), w_uv_Hvc.transpose(1, 2))
        return self.o_proj(o_HTv.transpose(0, 1).reshape(T, H * mla.v_head_dim).to(x_TD.dtype))
