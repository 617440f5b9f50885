"""Rotary embedding of q and k, with the q/k RMSNorm before it where the family has one, fused with the
K/V cache write: one launch per attention layer instead of the ~30 small ones of `RotaryEmbedding.forward`
(cos/sin included) + `store_kv`, and the two RMSNorm launches (PyTorch reference of the same signature:
`moe_infer.layers.rotary.rope_store_kv_ref`).

One program per token t: cos/sin of position positions_T[t] come from a table built once
(`RotaryEmbedding.cos_sin_cache`: row p = [cos_p[:d/2] | sin_p[:d/2]] in the model dtype, from the
float32 math of `cos_sin`); all H query heads and Hkv key heads are loaded as two halves [heads, d/2],
optionally RMS-normed (norm_mode "head": Qwen3, over each head's d, weights [d]; "proj": OLMoE at tp = 1,
over the whole q projection [H * d] and, apart, the whole k projection [Hkv * d]; v is never normed), then
rotated (rotate-half / NeoX layout: x1 = x[:d/2], x2 = x[d/2:], out = [x1*c - x2*s | x2*c + x1*s]); the
rotated k and v go to the caches at slot_mapping_T[t] (block slot // S, offset slot % S; slot < 0 is a
padding row and writes nothing); the rotated q goes to a new contiguous [T, H, d] tensor, the return value.

Rounding is transformers' (and the unfused `RMSNorm` + `RotaryEmbedding.forward`'s) exactly: torch computes each
elementwise op of 16-bit tensors in float32 and rounds once per op, so the kernel rounds to the model dtype op by
op (`_round`, round to nearest even): the norm's x * rsqrt(mean(x^2) + eps) (float32) once, its product with the
weight once, then x*c, x*s and their sum one by one; for float32 inputs the launch turns off FMA contraction
(`enable_fp_fusion=False`), which would otherwise fuse x*c + x*s into one rounding. One difference remains:
the float32 sum of squares is reduced in another order than torch's (or the RMSNorm kernel's), so where the
normed value sits on a rounding boundary of the dtype it can differ by one ulp (as `moe_infer.kernels.rms_norm`'s
does); without a norm the outputs are bit-identical.

No host sync and no data-dependent launch parameter: CUDA-graph capturable. Positions lie in the table
(the runner refuses a max_model_len over max_position_embeddings, the table's length; CUDA-graph padding
rows are at position 0); a position outside [0, P) is never read out of bounds: its cos and sin are 0.

Legend: T tokens, H query heads, Hkv KV heads, d head_dim, P table positions, Nb cache blocks, S block size.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter, use_pdl


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x (float32) rounded to nearest-even in the model dtype, back in float32 (a no-op for float32)."""
    if DTYPE == tl.bfloat16:
        # by hand: the Triton interpreter's float32 -> bfloat16 cast truncates (the GPU's rounds to
        # nearest even, as this does); the integer ops are free in a memory-bound kernel
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _load_halves(x_ptr, row_off, half, mask, HALF: tl.constexpr):
    """The two halves [heads, d/2] (float32) of the heads at x_ptr + row_off [heads, 1]; 0 where masked."""
    base = x_ptr + row_off
    x1 = tl.load(base + half[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + half[None, :], mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _rms_norm(x1, x2, w_ptr, head, half, mask, eps, NORM: tl.constexpr, HEADS: tl.constexpr,
              DTYPE: tl.constexpr, HALF: tl.constexpr):
    """RMSNorm of the halves (masked entries are 0 and add nothing to the squares) with torch's rounding:
    x * rsqrt(mean(x^2) + eps) in float32, rounded to the dtype, times the weight, rounded once.
    NORM 1 ("head"): over each head's d, weight [d]; NORM 2 ("proj"): over all HEADS * d, weight [HEADS * d]."""
    sum_sq_h = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if NORM == 1:
        inv_h1 = tl.rsqrt(sum_sq_h / (2 * HALF) + eps)[:, None]
        w_off = half[None, :] + head[:, None] * 0
    else:
        inv_h1 = tl.rsqrt(tl.sum(sum_sq_h, axis=0) / (HEADS * 2 * HALF) + eps)
        w_off = head[:, None] * (2 * HALF) + half[None, :]
    w1 = tl.load(w_ptr + w_off, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + w_off, mask=mask, other=0.0).to(tl.float32)
    return _round(w1 * _round(x1 * inv_h1, DTYPE), DTYPE), _round(w2 * _round(x2 * inv_h1, DTYPE), DTYPE)


@triton.jit
def _rotate(x1, x2, c, s, DTYPE: tl.constexpr):
    """The two rotated halves (float32, rounded as torch does) of the halves x1, x2 [heads, d/2]."""
    out1 = _round(_round(x1 * c, DTYPE) - _round(x2 * s, DTYPE), DTYPE)
    out2 = _round(_round(x2 * c, DTYPE) + _round(x1 * s, DTYPE), DTYPE)
    return out1, out2


@triton.jit(do_not_specialize=["positions_ptr", "slots_ptr"])
def rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, q_out_ptr,
    q_norm_ptr, k_norm_ptr, eps, num_positions,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_cp,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, DTYPE: tl.constexpr,
    NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    half_ok = half < HALF
    cs_ok = half_ok & (half * 0 + pos >= 0) & (half * 0 + pos < num_positions)
    c_1h = tl.load(cos_sin_ptr + pos * stride_cp + half, mask=cs_ok, other=0.0).to(tl.float32)[None, :]
    s_1h = tl.load(cos_sin_ptr + pos * stride_cp + HALF + half, mask=cs_ok, other=0.0).to(tl.float32)[None, :]
    # positions, slots and the table are the step's inputs and a constant: read above, before waiting on the qkv GEMM
    pdl_enter(USE_PDL)

    head = tl.arange(0, BLOCK_H)
    mask = (head < H)[:, None] & half_ok[None, :]
    q1, q2 = _load_halves(q_ptr, t * stride_qt + head[:, None] * stride_qh, half, mask, HALF)
    if NORM != 0:
        q1, q2 = _rms_norm(q1, q2, q_norm_ptr, head, half, mask, eps, NORM, H, DTYPE, HALF)
    q1, q2 = _rotate(q1, q2, c_1h, s_1h, DTYPE)
    out = q_out_ptr + t * stride_ot + head[:, None] * stride_oh + half[None, :]
    tl.store(out, q1.to(DTYPE), mask=mask)
    tl.store(out + HALF, q2.to(DTYPE), mask=mask)

    kv_head = tl.arange(0, BLOCK_HKV)
    kv_ok = (kv_head < HKV) & (kv_head * 0 + slot >= 0)  # a padding row (slot < 0) writes nothing
    kv_mask = kv_ok[:, None] & half_ok[None, :]
    k1, k2 = _load_halves(k_ptr, t * stride_kt + kv_head[:, None] * stride_kh, half, kv_mask, HALF)
    if NORM != 0:
        k1, k2 = _rms_norm(k1, k2, k_norm_ptr, kv_head, half, kv_mask, eps, NORM, HKV, DTYPE, HALF)
    k1, k2 = _rotate(k1, k2, c_1h, s_1h, DTYPE)
    block, offset = slot // PAGE, slot % PAGE
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + kv_head[:, None] * stride_kch + half[None, :]
    tl.store(k_dst, k1.to(DTYPE), mask=kv_mask)
    tl.store(k_dst + HALF, k2.to(DTYPE), mask=kv_mask)
    v_src = v_ptr + t * stride_vt + kv_head[:, None] * stride_vh + half[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + kv_head[:, None] * stride_vch + half[None, :]
    tl.store(v_dst, tl.load(v_src, mask=kv_mask), mask=kv_mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)


# Programmatic dependent launch: the kernel is placed on the SMs while the qkv GEMM drains and reads the step's
# positions, slots and the cos/sin table meanwhile; the attention kernel after it starts early in turn. "0" turns
# it off (A/B runs).
PDL_ENV = "MOE_ROPE_PDL"
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
NORM_MODES = {"none": 0, "head": 1, "proj": 2}  # the kernel's NORM constexpr of each q/k norm mode


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_norm(norm_mode: str, q_norm_weight: Optional[torch.Tensor], k_norm_weight: Optional[torch.Tensor],
                q_THd: torch.Tensor, Hkv: int) -> None:
    _check(norm_mode in NORM_MODES, f"norm_mode must be one of {list(NORM_MODES)}, got {norm_mode!r}")
    if norm_mode == "none":
        return
    _, H, d = q_THd.shape
    sizes = {"head": (d, d), "proj": (H * d, Hkv * d)}[norm_mode]
    for name, w, size in (("q_norm_weight", q_norm_weight, sizes[0]), ("k_norm_weight", k_norm_weight, sizes[1])):
        _check(w is not None, f"norm_mode {norm_mode!r} needs {name}")
        _check(w.shape == (size,) and w.stride() == (1,) and w.dtype == q_THd.dtype and w.device == q_THd.device,
               f"{name} {tuple(w.shape)} {w.dtype} on {w.device} (strides {w.stride()}) must be a contiguous "
               f"[{size}] {q_THd.dtype} on {q_THd.device} for norm_mode {norm_mode!r}")


def check_inputs(who: str, q_THd: torch.Tensor, k_THd: torch.Tensor, v_THd: torch.Tensor, positions_T: torch.Tensor,
                 cos_sin_Pd: torch.Tensor, k_cache_NbSHd: torch.Tensor, v_cache_NbSHd: torch.Tensor,
                 slot_mapping_T: torch.Tensor) -> None:
    """The checks of a q/k/v + RoPE + cache-write kernel's inputs (`rope_store_kv`, and the decode kernel of
    rope_decode_attention.py): shapes, dtypes, unit last strides, one device, CUDA or the interpreter."""
    T, H, d = q_THd.shape
    Nb, S, Hkv, dk = k_cache_NbSHd.shape
    _check(d % 2 == 0 and dk == d and k_THd.shape == (T, Hkv, d) and v_THd.shape == (T, Hkv, d)
           and v_cache_NbSHd.shape == k_cache_NbSHd.shape,
           f"q {tuple(q_THd.shape)}, k {tuple(k_THd.shape)}, v {tuple(v_THd.shape)} do not fit caches "
           f"k {tuple(k_cache_NbSHd.shape)} / v {tuple(v_cache_NbSHd.shape)}")
    _check(positions_T.shape == (T,) and slot_mapping_T.shape == (T,),
           f"positions {tuple(positions_T.shape)} and slot_mapping {tuple(slot_mapping_T.shape)} must be [{T}]")
    _check(cos_sin_Pd.dim() == 2 and cos_sin_Pd.shape[1] == d, f"cos_sin table {tuple(cos_sin_Pd.shape)} must be [P, {d}]")
    _check(q_THd.dtype in _TL_DTYPES, f"{who} supports {list(_TL_DTYPES)}, got {q_THd.dtype}")
    for name, t in (("k", k_THd), ("v", v_THd), ("cos_sin", cos_sin_Pd), ("k_cache", k_cache_NbSHd),
                    ("v_cache", v_cache_NbSHd)):
        _check(t.dtype == q_THd.dtype, f"{name} is {t.dtype}, q is {q_THd.dtype}")
    for name, t in (("q", q_THd), ("k", k_THd), ("v", v_THd), ("cos_sin", cos_sin_Pd), ("k_cache", k_cache_NbSHd),
                    ("v_cache", v_cache_NbSHd)):
        _check(t.stride(-1) == 1, f"{name} needs a unit stride on its last dim, got {t.stride()}")
    for name, t in (("k", k_THd), ("v", v_THd), ("positions", positions_T), ("cos_sin", cos_sin_Pd),
                    ("k_cache", k_cache_NbSHd), ("v_cache", v_cache_NbSHd), ("slot_mapping", slot_mapping_T)):
        _check(t.device == q_THd.device, f"{name} is on {t.device}, q on {q_THd.device}")
    _check(q_THd.is_cuda or os.environ.get("TRITON_INTERPRET") == "1",
           f"{who} is a Triton kernel: it needs CUDA tensors (or TRITON_INTERPRET=1), got {q_THd.device}")


def rope_store_kv(
    q_THd: torch.Tensor, k_THd: torch.Tensor, v_THd: torch.Tensor, positions_T: torch.Tensor,
    cos_sin_Pd: torch.Tensor, k_cache_NbSHd: torch.Tensor, v_cache_NbSHd: torch.Tensor, slot_mapping_T: torch.Tensor,
    *, q_norm_weight: Optional[torch.Tensor] = None, k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 0.0, norm_mode: str = "none",
) -> torch.Tensor:
    """RMSNorm q [T, H, d] and k [T, Hkv, d] (norm_mode "head": over d, weights [d]; "proj": over the whole
    projection, weights [H * d] / [Hkv * d]; "none": no norm), rotate them at positions_T, write k and v into
    the caches at slot_mapping_T (in place; slots < 0 skipped) -> rotated q, a new contiguous [T, H, d] tensor.

    q, k, v may be strided views (the fused qkv projection's split) with a unit stride on d; cos_sin_Pd is
    `RotaryEmbedding.cos_sin_cache` ([P, d] in q's dtype)."""
    check_inputs("rope_store_kv", q_THd, k_THd, v_THd, positions_T, cos_sin_Pd, k_cache_NbSHd, v_cache_NbSHd,
                 slot_mapping_T)
    T, H, d = q_THd.shape
    S, Hkv = k_cache_NbSHd.shape[1:3]
    _check_norm(norm_mode, q_norm_weight, k_norm_weight, q_THd, Hkv)
    q_out_THd = torch.empty((T, H, d), dtype=q_THd.dtype, device=q_THd.device)
    if T == 0:
        return q_out_THd
    rope_store_kv_kernel[(T,)](
        q_THd, k_THd, v_THd, positions_T, cos_sin_Pd, k_cache_NbSHd, v_cache_NbSHd, slot_mapping_T, q_out_THd,
        q_THd if q_norm_weight is None else q_norm_weight, k_THd if k_norm_weight is None else k_norm_weight,
        float(norm_eps), cos_sin_Pd.shape[0],
        q_THd.stride(0), q_THd.stride(1), k_THd.stride(0), k_THd.stride(1), v_THd.stride(0), v_THd.stride(1),
        q_out_THd.stride(0), q_out_THd.stride(1), cos_sin_Pd.stride(0),
        k_cache_NbSHd.stride(0), k_cache_NbSHd.stride(1), k_cache_NbSHd.stride(2),
        v_cache_NbSHd.stride(0), v_cache_NbSHd.stride(1), v_cache_NbSHd.stride(2),
        H=H, HKV=Hkv, HALF=d // 2, PAGE=S, BLOCK_H=triton.next_power_of_2(H),
        BLOCK_HKV=triton.next_power_of_2(Hkv), BLOCK_HALF=triton.next_power_of_2(d // 2),
        DTYPE=_TL_DTYPES[q_THd.dtype], NORM=NORM_MODES[norm_mode], num_warps=4 if H * d >= 2048 else 1,
        enable_fp_fusion=False,  # x*c + x*s as two roundings, as torch does (float32 inputs)
        **use_pdl(q_THd, PDL_ENV),
    )
    return q_out_THd
