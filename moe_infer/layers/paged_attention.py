"""Paged attention, pure-PyTorch reference: the checked-against path for the Triton kernels.

The KV cache of one layer is two tensors [num_blocks, block_size, Hkv, d]; token slot s lives at
block s // block_size, offset s % block_size. A step's tokens are flattened (T) and grouped by
sequence through `query_start_loc_B1`; sequence b reads its keys through `block_tables_BM[b]`.

`store_kv` writes the step's K/V at `slot_mapping_T` (slots < 0 are padding and skipped; no host
sync);
`paged_attention_ref` then attends every query over its sequence's cached keys 0..seq_len-1 with a
causal mask by position (key j is visible to a query at position p iff j <= p, and p - j < window
when a sliding window is set). Vectorised over tokens: queries are scattered into a padded
[B, Qmax] layout, keys gathered to [B, L]; no Python loop over tokens or sequences. In a mixed
step (decodes beside prefill chunks) the single-token sequences are attended as their own group,
so they are not padded to the longest chunk (one host sync: the group sizes). Computed in
float32, returned in q's dtype. Memory: B * L * Hkv * d gathered keys and values, B * H * Qmax * L
scores per group; a reference, not a kernel. `paged_attention_sdpa` (same signature) does the
same gather and hands the masked dense attention to torch's SDPA in q's dtype (CUDA without triton).
The paged Triton kernel that reads K/V in place is `moe_infer.kernels.paged_attention` ("triton",
the CUDA default).

Legend: T tokens, B sequences, M max blocks per sequence, Qmax max query tokens of a sequence,
L max context length, H query heads, Hkv KV heads, G = H / Hkv, d head_dim, Nb blocks, S block size.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from moe_infer.layers.forward_context import AttentionMetadata
from moe_infer.registry import Registry


def store_kv(
    k_THd: torch.Tensor, v_THd: torch.Tensor, k_cache_NbSHd: torch.Tensor, v_cache_NbSHd: torch.Tensor,
    slot_mapping_T: torch.Tensor, k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Write each token's K/V into the cache at its slot (in place); negative slots are skipped. An fp8 cache
    stores k / k_scale[h] and v / v_scale[h] in e4m3 (`quantize_kv`)."""
    if k_THd.shape != v_THd.shape or k_THd.shape[1:] != k_cache_NbSHd.shape[2:]:
        raise ValueError(
            f"k {tuple(k_THd.shape)} / v {tuple(v_THd.shape)} do not fit cache {tuple(k_cache_NbSHd.shape)}"
        )
    for new_THd, cache, kv_scale in ((k_THd, k_cache_NbSHd, k_scale), (v_THd, v_cache_NbSHd, v_scale)):
        if cache.dtype == KV_FP8:
            new_THd, cache = quantize_kv(new_THd, kv_scale).view(torch.uint8), cache.view(torch.uint8)
        store_rows(new_THd, cache, slot_mapping_T)


KV_FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_kv(new_THd: torch.Tensor, scale_H: Optional[torch.Tensor]) -> torch.Tensor:
    """e4m3 of new / scale per head (scale None: 1), saturated at +-448."""
    x = new_THd.float()
    if scale_H is not None:
        x = x / scale_H.float()[None, :, None]
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8)


def _gather_rows(cache_NbSHd: torch.Tensor, slots_BL: torch.Tensor, scale_H: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows [B, L, H, d] of a cache at the slots; an fp8 cache's dequantized to float32 (times its scale)."""
    Nb, S, H, d = cache_NbSHd.shape
    if cache_NbSHd.dtype != KV_FP8:
        return cache_NbSHd.view(Nb * S, H, d)[slots_BL]
    rows = cache_NbSHd.view(torch.uint8).view(Nb * S, H, d)[slots_BL].view(KV_FP8).float()
    return rows if scale_H is None else rows * scale_H.float()[None, None, :, None]


def store_rows(new_THd: torch.Tensor, cache_NbSHd: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """Write each token's rows [H, d] into one cache at its slot (in place); negative slots are skipped (K and V
    each, or MLA's one latent cache)."""
    if new_THd.shape[1:] != cache_NbSHd.shape[2:]:
        raise ValueError(f"rows {tuple(new_THd.shape)} do not fit cache {tuple(cache_NbSHd.shape)}")
    if slot_mapping_T.shape != new_THd.shape[:1]:
        raise ValueError(f"slot_mapping {tuple(slot_mapping_T.shape)} does not match {new_THd.shape[0]} tokens")
    if new_THd.shape[0] == 0:
        return
    slots_T = slot_mapping_T.long()
    # No host sync (CUDA-graph safe): a padding row repeats the first valid row's write (same slot,
    # same value, so the duplicate index is harmless); with no valid row at all, every row writes
    # slot 0's own value back.
    # Indexing with a 0-dim tensor would read it on the host: index_select keeps it on the device.
    valid_T = slots_T >= 0
    first_1 = torch.argmax(valid_T.int()).reshape(1)
    any_valid_1 = valid_T.index_select(0, first_1)
    fill_slot_1 = torch.where(any_valid_1, slots_T.index_select(0, first_1), torch.zeros_like(first_1))
    dst_T = torch.where(valid_T, slots_T, fill_slot_1)
    flat = cache_NbSHd.view(-1, *cache_NbSHd.shape[2:])
    new_THd = new_THd.to(flat.dtype)
    fill_1Hd = torch.where(any_valid_1[:, None, None], new_THd.index_select(0, first_1),
                           flat.index_select(0, fill_slot_1))
    flat.index_put_((dst_T,), torch.where(valid_T[:, None, None], new_THd, fill_1Hd))


def paged_attention_ref(
    q_THd: torch.Tensor,
    k_cache_NbSHd: torch.Tensor,
    v_cache_NbSHd: torch.Tensor,
    block_tables_BM: torch.Tensor,
    seq_lens_B: torch.Tensor,
    query_start_loc_B1: torch.Tensor,
    positions_T: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: Optional[int] = None,
    sinks_H: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [T, H, d] -> out [T, H, dv] over the cached keys of each token's sequence (float32 math). The value
    cache may be narrower than the key cache (dv <= d: MLA reads its values as the first kv_lora_rank entries of
    the latent row, a view of the key cache). sinks_H: a logit per query head added to each softmax's
    denominator (GPT-OSS's attention sinks; a key-less extra column that takes probability and gives no value).
    An fp8 cache is read as e4m3 values times k_scale / v_scale [Hkv]."""
    return _paged(_dense_fp32, q_THd, k_cache_NbSHd, v_cache_NbSHd, block_tables_BM, seq_lens_B,
                  query_start_loc_B1, positions_T, scale, max_query_len, max_seq_len, sliding_window, sinks_H,
                  k_scale, v_scale)


def paged_attention_sdpa(
    q_THd: torch.Tensor,
    k_cache_NbSHd: torch.Tensor,
    v_cache_NbSHd: torch.Tensor,
    block_tables_BM: torch.Tensor,
    seq_lens_B: torch.Tensor,
    query_start_loc_B1: torch.Tensor,
    positions_T: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: Optional[int] = None,
    sinks_H: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """paged_attention_ref's gather, then torch's scaled_dot_product_attention in q's dtype (a
    faster, leaner stand-in on GPU until a paged Triton kernel exists; not the reference)."""
    return _paged(_dense_sdpa, q_THd, k_cache_NbSHd, v_cache_NbSHd, block_tables_BM, seq_lens_B,
                  query_start_loc_B1, positions_T, scale, max_query_len, max_seq_len, sliding_window, sinks_H,
                  k_scale, v_scale)


def _paged(dense, q_THd, k_cache_NbSHd, v_cache_NbSHd, block_tables_BM, seq_lens_B, query_start_loc_B1,
           positions_T, scale, max_query_len, max_seq_len, sliding_window, sinks_H=None, k_scale=None,
           v_scale=None) -> torch.Tensor:
    T, H, d = q_THd.shape
    Nb, S, Hkv, dk = k_cache_NbSHd.shape
    B, dv = seq_lens_B.shape[0], v_cache_NbSHd.shape[-1]
    if dk != d or H % Hkv or v_cache_NbSHd.shape[:3] != k_cache_NbSHd.shape[:3]:
        raise ValueError(
            f"q {tuple(q_THd.shape)} does not fit cache {tuple(k_cache_NbSHd.shape)} (GQA needs H % Hkv == 0)"
        )
    if query_start_loc_B1.shape[0] != B + 1 or block_tables_BM.shape[0] != B:
        raise ValueError("query_start_loc must have B+1 entries and block_tables B rows, B = len(seq_lens)")
    if sinks_H is not None and tuple(sinks_H.shape) != (H,):
        raise ValueError(f"sinks {tuple(sinks_H.shape)} must hold one logit per query head ({H})")
    dev = q_THd.device
    Qmax, L = max(int(max_query_len), 1), max(int(max_seq_len), 1)
    # token -> (sequence b, row i within the sequence's queries)
    tok_T = torch.arange(T, device=dev)
    starts_B1 = query_start_loc_B1.long()
    seq_T = torch.searchsorted(starts_B1[1:], tok_T, right=True).clamp_max(B - 1)
    row_T = tok_T - starts_B1[seq_T]
    args = (k_cache_NbSHd, v_cache_NbSHd, scale, L, sliding_window, dense, sinks_H, k_scale, v_scale)
    if Qmax > 1:  # a mixed step: padding decodes to Qmax would cost B * Qmax rows, so split them off
        is_multi_B = (starts_B1[1:] - starts_B1[:-1]) > 1
        num_multi = int(is_multi_B.sum())  # the one host sync, in steps with a prefill chunk only
        if 0 < num_multi < B:
            out_THd = q_THd.new_empty(T, H, dv)
            for group_B, group_Qmax in ((~is_multi_B, 1), (is_multi_B, Qmax)):
                seqs_b = group_B.nonzero().squeeze(1)
                tok_t = group_B[seq_T].nonzero().squeeze(1)
                local_B = torch.cumsum(group_B.long(), 0) - 1
                out_THd[tok_t] = _attend_padded(
                    q_THd[tok_t], local_B[seq_T[tok_t]], row_T[tok_t], positions_T[tok_t],
                    block_tables_BM[seqs_b], seq_lens_B[seqs_b], group_Qmax, *args,
                )
            return out_THd
    return _attend_padded(q_THd, seq_T, row_T, positions_T, block_tables_BM, seq_lens_B, Qmax, *args)


def _attend_padded(
    q_THd: torch.Tensor, seq_T: torch.Tensor, row_T: torch.Tensor, positions_T: torch.Tensor,
    block_tables_BM: torch.Tensor, seq_lens_B: torch.Tensor, Qmax: int,
    k_cache_NbSHd: torch.Tensor, v_cache_NbSHd: torch.Tensor, scale: float, L: int, sliding_window: Optional[int],
    dense: Callable[..., torch.Tensor], sinks_H: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Queries scattered to [B, Qmax] (token t at row_T[t] of sequence seq_T[t]), keys gathered to [B, L]."""
    T, H, d = q_THd.shape
    Nb, S, Hkv, _ = k_cache_NbSHd.shape
    B, dev = block_tables_BM.shape[0], q_THd.device
    q_BQHd = q_THd.new_zeros(B, Qmax, H, d)
    q_BQHd[seq_T, row_T] = q_THd
    pos_BQ = torch.full((B, Qmax), -1, dtype=torch.long, device=dev)
    pos_BQ[seq_T, row_T] = positions_T.long()

    # gather keys 0..L-1 of each sequence through its block table
    key_L = torch.arange(L, device=dev)
    blocks_BL = block_tables_BM.long()[:, (key_L // S).clamp_max(block_tables_BM.shape[1] - 1)]
    slots_BL = blocks_BL.clamp_min(0) * S + key_L % S
    is_key_BL = (key_L[None, :] < seq_lens_B.long()[:, None]) & (blocks_BL >= 0)
    # slots past a sequence's end were never written (garbage, even NaN): zero them so 0 * x stays 0
    not_key_BL11 = ~is_key_BL[:, :, None, None]
    k_BLHd = _gather_rows(k_cache_NbSHd, slots_BL, k_scale).masked_fill(not_key_BL11, 0.0)
    v_BLHd = _gather_rows(v_cache_NbSHd, slots_BL, v_scale).masked_fill(not_key_BL11, 0.0)

    key_pos_BQL = key_L[None, None, :]
    visible_BQL = (key_pos_BQL <= pos_BQ[:, :, None]) & is_key_BL[:, None, :]
    if sliding_window is not None:
        visible_BQL &= pos_BQ[:, :, None] - key_pos_BQL < sliding_window
    visible_BQL |= (pos_BQ < 0)[:, :, None] & (key_pos_BQL == 0)  # padded query rows see key 0: no NaN rows
    out_BQHd = dense(q_BQHd, k_BLHd, v_BLHd, visible_BQL, scale, sinks_H)
    return out_BQHd[seq_T, row_T].to(q_THd.dtype)


def _dense_fp32(q_BQHd, k_BLHd, v_BLHd, visible_BQL, scale: float, sinks_H=None) -> torch.Tensor:
    """Masked attention in float32; scores [B, Hkv, G, Qmax, L] without repeating K/V per group. With sinks, each
    head's sink logit is one more column of the softmax, dropped after it (its probability weighs no value)."""
    B, Qmax, H, d = q_BQHd.shape
    Hkv, dv = k_BLHd.shape[2], v_BLHd.shape[-1]
    q_BHkvGQd = q_BQHd.float().view(B, Qmax, Hkv, H // Hkv, d).permute(0, 2, 3, 1, 4)
    scores = torch.matmul(q_BHkvGQd, k_BLHd.float().permute(0, 2, 3, 1)[:, :, None]) * scale
    scores = scores.masked_fill(~visible_BQL[:, None, None], float("-inf"))
    if sinks_H is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks_H.float().view(1, Hkv, H // Hkv, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out_BHkvGQd = torch.matmul(probs, v_BLHd.float().permute(0, 2, 1, 3)[:, :, None])
    return out_BHkvGQd.permute(0, 3, 1, 2, 4).reshape(B, Qmax, H, dv)


def _dense_sdpa(q_BQHd, k_BLHd, v_BLHd, visible_BQL, scale: float, sinks_H=None) -> torch.Tensor:
    """Masked attention by torch's SDPA in the inputs' dtype (K/V heads repeated for GQA). Sinks: one more key of
    zeros with a zero value, whose additive mask entry is the head's sink logit (its score: 0 + sink)."""
    B, L, Hkv, d = k_BLHd.shape
    H, Qmax = q_BQHd.shape[2], q_BQHd.shape[1]
    G = H // Hkv
    # head h reads kv head h // G; expand + reshape copies once and, unlike repeat_interleave on CUDA,
    # never reads a size back to the host
    k_BHLd = k_BLHd.permute(0, 2, 1, 3)[:, :, None].expand(B, Hkv, G, L, d).reshape(B, Hkv * G, L, d)
    v_BHLd = v_BLHd.permute(0, 2, 1, 3)[:, :, None].expand(B, Hkv, G, L, d).reshape(B, Hkv * G, L, d)
    mask = visible_BQL[:, None]
    if sinks_H is not None:
        k_BHLd = torch.cat([k_BHLd, k_BHLd.new_zeros(B, H, 1, d)], dim=2)
        v_BHLd = torch.cat([v_BHLd, v_BHLd.new_zeros(B, H, 1, d)], dim=2)
        bias = torch.zeros(B, 1, Qmax, L, dtype=q_BQHd.dtype, device=q_BQHd.device).masked_fill(~mask, float("-inf"))
        sink = sinks_H.to(q_BQHd.dtype).view(1, H, 1, 1).expand(B, H, Qmax, 1)
        mask = torch.cat([bias.expand(B, H, Qmax, L), sink], dim=-1)
    out_BHQd = F.scaled_dot_product_attention(
        q_BQHd.permute(0, 2, 1, 3), k_BHLd.to(q_BQHd.dtype), v_BHLd.to(q_BQHd.dtype),
        attn_mask=mask, scale=scale,
    )
    return out_BHQd.permute(0, 2, 1, 3)


# ---- backends: one call writes the step's K/V and attends; a Triton kernel registers beside "torch" ----

AttentionFn = Callable[..., torch.Tensor]
ATTENTION_BACKENDS: Registry[AttentionFn] = Registry("attention backend")


# "auto" takes the first registered name for the device type: on CUDA the paged Triton kernel
# (`layers/attention_triton.py`, registered where triton imports), measured 3.3-38x faster than the
# gather + SDPA path on an H100 (benchmarks/results/attention_*.json); without triton, "sdpa"
ATTENTION_AUTO = {"cuda": ("triton", "sdpa", "torch"), "cpu": ("torch",)}


def attend_cached(
    attend: Callable[..., torch.Tensor], q_THd: torch.Tensor, k_cache_NbSHd: torch.Tensor,
    v_cache_NbSHd: torch.Tensor, attn: AttentionMetadata, positions_T: torch.Tensor, scale: float,
    sliding_window: Optional[int] = None, sinks_H: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """attend (paged_attention_ref's signature) over caches that already hold the step's K/V -> out [T, H, d].
    Attend functions without sinks (MLA's) never get sinks_H; k_scale / v_scale (an fp8 cache's per-head scales) are
    passed only with one."""
    extra = {} if sinks_H is None else {"sinks_H": sinks_H}
    if k_scale is not None:
        extra.update(k_scale=k_scale, v_scale=v_scale)
    return attend(
        q_THd, k_cache_NbSHd, v_cache_NbSHd, attn.block_tables_BM, attn.seq_lens_B, attn.query_start_loc_B1,
        positions_T, scale, attn.max_query_len, attn.max_seq_len, sliding_window, **extra,
    )


def store_then_attend(attend: Callable[..., torch.Tensor]) -> AttentionFn:
    def backend(
        q_THd: torch.Tensor, k_THd: torch.Tensor, v_THd: torch.Tensor,
        k_cache_NbSHd: torch.Tensor, v_cache_NbSHd: torch.Tensor,
        attn: AttentionMetadata, positions_T: torch.Tensor, scale: float, sliding_window: Optional[int] = None,
        sinks_H: Optional[torch.Tensor] = None,
        k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """store_kv at attn.slot_mapping_T, then attend over the cache -> out [T, H, d]."""
        store_kv(k_THd, v_THd, k_cache_NbSHd, v_cache_NbSHd, attn.slot_mapping_T, k_scale, v_scale)
        return attend_cached(attend, q_THd, k_cache_NbSHd, v_cache_NbSHd, attn, positions_T, scale, sliding_window,
                             sinks_H, k_scale, v_scale)

    backend.attend = attend  # the attend-only part: for queries of fewer rows than the K/V written
    return backend


@dataclass(frozen=True)
class RopeFusedAttention:
    """A backend that also takes the step's K/V already rotated and written: `rope_store_kv` (the signature
    of `moe_infer.layers.rotary.rope_store_kv_ref`, q/k norm keywords included) RMS-norms q and k if asked,
    rotates them, writes k and v at the slots and returns the rotated q; `attend` (paged_attention_ref's
    signature) then reads the caches. `decode`, where given, does both in one call for the steps
    `decode_supports` accepts."""

    rope_store_kv: Callable[..., torch.Tensor]
    attend: Callable[..., torch.Tensor]
    # optional: all of it in one call for a decode step (`moe_infer.kernels.rope_decode_attention`'s signature),
    # where decode_supports(head_dim, norm_mode, max_query_len) says so
    decode: Optional[Callable[..., torch.Tensor]] = None
    decode_supports: Optional[Callable[[int, str, int], bool]] = None


# The attention backends whose layer runs the rotary embedding and the K/V write as one kernel (by the same
# name as their ATTENTION_BACKENDS entry); with any other, the layer rotates by RotaryEmbedding.forward and
# the ATTENTION_BACKENDS entry writes the K/V.
ROPE_FUSED_BACKENDS: Registry[RopeFusedAttention] = Registry("rope-fused attention backend")


ATTENTION_BACKENDS.register("torch")(store_then_attend(paged_attention_ref))
ATTENTION_BACKENDS.register("sdpa")(store_then_attend(paged_attention_sdpa))


def resolve_attention_backend(name: str, device: torch.device | str) -> str:
    """A registered attention backend name; "auto" picks by device type from ATTENTION_AUTO."""
    if name != "auto":
        ATTENTION_BACKENDS.get(name)  # raises naming the available ones
        if name == "triton" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"model.attention_backend=triton runs a Triton kernel, which needs a CUDA device; "
                             f"this engine runs on {device}: use auto, torch or sdpa")
        return name
    for candidate in ATTENTION_AUTO.get(torch.device(device).type, ("torch",)):
        if candidate in ATTENTION_BACKENDS:
            return candidate
    raise KeyError(f"attention backend auto: nothing registered for {device}; have {ATTENTION_BACKENDS.names()}")
