"""RMSNorm in one launch, optionally fused with the residual add before it.

    y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)                       rms_norm_triton
    h' = (h + delta).to(dtype);  y = rms_norm(h')                          add_rms_norm_triton

transformers' rounding (the reference, `moe_infer.layers.norm.RMSNorm`'s torch path): the row is
normalised in float32, cast to the input dtype, then multiplied by the weight in that dtype (one
rounding of the float32 product); the residual add rounds once to the dtype and the norm reads the
rounded sum. The float32 sum of squares is reduced in a different order than torch's, so a result
can differ from the torch path by one ulp of the dtype where the float32 value sits on a rounding
boundary.

Rows are the leading dims: x [T, N] or [T, H, N] (a per-head norm, e.g. Qwen3's q/k norm on a view
of the fused qkv projection: strides (qkv width, N, 1)). The last dim must have unit stride; the
output is contiguous. One program per row; no host syncs (CUDA-graph safe).

Legend: T tokens, H heads (1 for a hidden-size norm), N normalised size.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter, use_pdl

# Launched with programmatic dependent launch (sm_90+): the kernel after a norm (a decode-sized linear
# layer, `skinny_gemm`) is placed on the SMs as the norm starts and reads its weights meanwhile.
# "0" turns it off (A/B runs).
PDL_ENV = "MOE_NORM_PDL"


@triton.jit
def rms_norm_kernel(x_ptr, d_ptr, w_ptr, y_ptr, h_out_ptr, eps, H, N, stride_xt, stride_xh, stride_dt, stride_dh,
                    HAS_DELTA: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    t, h = row // H, row % H
    offs_N = tl.arange(0, BLOCK_N)
    mask_N = offs_N < N
    w_N = tl.load(w_ptr + offs_N, mask=mask_N, other=0.0)  # a weight: read before waiting on the kernel before
    pdl_enter(USE_PDL)
    x_N = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs_N, mask=mask_N, other=0.0)
    if HAS_DELTA:  # h' = h + delta, rounded to the dtype once, as torch's add
        d_N = tl.load(d_ptr + t * stride_dt + h * stride_dh + offs_N, mask=mask_N, other=0.0)
        x_N = (x_N.to(tl.float32) + d_N.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_out_ptr + row * N + offs_N, x_N, mask=mask_N)
    x32_N = x_N.to(tl.float32)
    var = tl.sum(x32_N * x32_N, axis=0) / N
    normed_N = (x32_N * tl.rsqrt(var + eps)).to(y_ptr.dtype.element_ty)
    y_N = (w_N.to(tl.float32) * normed_N.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * N + offs_N, y_N, mask=mask_N)


def _rows(x: torch.Tensor, name: str) -> Tuple[int, int, int, int]:
    """(T, H, stride over T, stride over H) of x [T, N] or [T, H, N] with a unit last stride."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, N] or [T, H, N] with a unit last stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def _launch(x: torch.Tensor, delta, weight_N: torch.Tensor, eps: float):
    T, H, sxt, sxh = _rows(x, "x")
    N = x.shape[-1]
    if weight_N.shape != (N,) or weight_N.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight_N.shape)} {weight_N.dtype} does not fit x [..., {N}] {x.dtype}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h_out = torch.empty_like(y) if delta is not None else y
    sdt = sdh = 0
    if delta is not None:
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} does not match x {tuple(x.shape)} {x.dtype}")
        _, _, sdt, sdh = _rows(delta, "delta")
    if T * H == 0:
        return h_out, y
    block = triton.next_power_of_2(N)
    warps = 1 if block <= 256 else 4 if block <= 4096 else 8
    rms_norm_kernel[(T * H,)](x, delta if delta is not None else x, weight_N, y, h_out, float(eps), H, N,
                              sxt, sxh, sdt, sdh, HAS_DELTA=delta is not None, BLOCK_N=block, num_warps=warps,
                              **use_pdl(x, PDL_ENV))
    return h_out, y


def rms_norm_triton(x: torch.Tensor, weight_N: torch.Tensor, eps: float) -> torch.Tensor:
    """y (contiguous, x's shape and dtype) = RMSNorm(x) with transformers' rounding."""
    return _launch(x, None, weight_N, eps)[1]


def add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor, weight_N: torch.Tensor,
                        eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta)) in one launch; both contiguous in h's dtype."""
    return _launch(h, delta, weight_N, eps)
