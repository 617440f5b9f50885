"""PyTorch references of the block-scaled FP8 (W8A8) kernels: DeepSeek-V3 / Qwen3 FP8 checkpoints.

Weights are float8_e4m3fn with one float32 scale per block_n x block_k block ("weight_scale_inv"):
    w[n, k] = w_fp8[n, k] * scale_inv[n // block_n, k // block_k]       (the last blocks may be partial)
Activations are quantized on the fly per token and per group of `group` values along K:
    scale[t, g] = max(max |x[t, g*group : (g+1)*group]|, SCALE_EPS) / FP8_MAX
    x_fp8[t, k] = round_to_e4m3(clamp(x[t, k] / scale[t, k // group], -FP8_MAX, FP8_MAX))
A W8A8 GEMM sums, over K blocks kb, the float32 dot of the fp8 blocks times x's and w's scales:
    y[t, n] = sum_kb (x_fp8[t, kb] . w_fp8[n, kb]) * x_scale[t, kb] * w_scale[n // block_n, kb]

    per_token_group_quant_fp8_ref(x_TK, group) -> (x_fp8_TK, scale_TG)
    dequant_block_fp8_ref(w_NK_fp8, scale_inv_nk, block_n, block_k) -> w_NK float32
    w8a8_block_gemm_ref(x_TK, w_NK_fp8, scale_inv, block_n, block_k, out_dtype) -> y_TN
    fused_moe_fp8_ref(x_TD, topk_ids_TK, topk_weights_TK, w13_E2FD_fp8, w13_scale, w2_EDF_fp8, w2_scale,
                      block_n, block_k) -> out_TD

The Triton kernels (fp8_gemm.py, fused_moe_fp8.py) quantize the same way (IEEE division, round to
nearest even), so they differ from these only by the order of float32 sums.

Legend: T tokens, K reduction dim (hidden size for a GEMM), N output columns, G = K / group groups,
n = ceil(N / block_n) and k = ceil(K / block_k) scale blocks, D hidden, F expert intermediate,
E experts, K top-k (in the MoE signature).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F_

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_EPS = 1e-10  # an all-zero group gets this amax: a finite scale, zeros stay zeros


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_block_scale(w_NK: torch.Tensor, scale_nk: torch.Tensor, block_n: int, block_k: int, name: str) -> None:
    """w_NK is float8_e4m3fn [N, K] and scale_nk float32 [ceil(N / block_n), ceil(K / block_k)]."""
    _check(block_n >= 16 and block_k >= 16 and block_n % 16 == 0 and block_k % 16 == 0,
           f"block_n and block_k must be multiples of 16, got {block_n}, {block_k}")
    _check(w_NK.dtype == FP8_DTYPE, f"{name} must be {FP8_DTYPE}, got {w_NK.dtype}")
    N, K = w_NK.shape[-2:]
    want = (*w_NK.shape[:-2], _cdiv(N, block_n), _cdiv(K, block_k))
    _check(scale_nk.dtype == torch.float32 and tuple(scale_nk.shape) == want,
           f"{name}'s scale must be float32 {want}, got {scale_nk.dtype} {tuple(scale_nk.shape)}")
    _check(scale_nk.device == w_NK.device, f"{name} and its scale are on {w_NK.device} and {scale_nk.device}")


def per_token_group_quant_fp8_ref(x_TK: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8_TK float8_e4m3fn, scale_TG float32): x_TK ~= x_fp8_TK * scale_TG repeated `group` times."""
    _check(x_TK.dim() == 2, f"x must be 2-D [T, K], got {tuple(x_TK.shape)}")
    T, K = x_TK.shape
    _check(group >= 1 and K % group == 0, f"K={K} must be a multiple of the group size {group}")
    x_TGC = x_TK.float().reshape(T, K // group, group)
    amax_TG = x_TGC.abs().amax(dim=-1).clamp_min(SCALE_EPS)
    scale_TG = amax_TG / torch.full_like(amax_TG, FP8_MAX)  # a tensor divisor: CUDA multiplies by 1/448 for a scalar
    x_fp8 = (x_TGC / scale_TG[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8.reshape(T, K), scale_TG


def dequant_block_fp8_ref(w_NK_fp8: torch.Tensor, scale_inv_nk: torch.Tensor, block_n: int,
                          block_k: int) -> torch.Tensor:
    """w_NK float32 = w_fp8 * its block's scale (the last row / column blocks may be partial)."""
    _check(w_NK_fp8.dim() == 2, f"w must be 2-D [N, K], got {tuple(w_NK_fp8.shape)}")
    check_block_scale(w_NK_fp8, scale_inv_nk, block_n, block_k, "w")
    N, K = w_NK_fp8.shape
    scale_NK = scale_inv_nk.repeat_interleave(block_n, dim=0)[:N].repeat_interleave(block_k, dim=1)[:, :K]
    return w_NK_fp8.float() * scale_NK


def w8a8_block_gemm_ref(x_TK: torch.Tensor, w_NK_fp8: torch.Tensor, scale_inv: torch.Tensor, block_n: int,
                        block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """y_TN = x_TK @ w^T the W8A8 way: x quantized per token group of block_k, one float32 dot per K block,
    scaled by x's and w's block scales, summed in K order, cast once to out_dtype."""
    _check(x_TK.dim() == 2 and w_NK_fp8.dim() == 2 and x_TK.shape[1] == w_NK_fp8.shape[1],
           f"x {tuple(x_TK.shape)} and w {tuple(w_NK_fp8.shape)} must be [T, K] and [N, K]")
    check_block_scale(w_NK_fp8, scale_inv, block_n, block_k, "w")
    (T, K), N = x_TK.shape, w_NK_fp8.shape[0]
    x_fp8, x_scale_TG = per_token_group_quant_fp8_ref(x_TK, block_k)
    w_scale_NG = scale_inv.repeat_interleave(block_n, dim=0)[:N]
    xq, wq = x_fp8.float(), w_NK_fp8.float()
    y_TN = torch.zeros(T, N, dtype=torch.float32, device=x_TK.device)
    for kb in range(K // block_k):
        cols = slice(kb * block_k, (kb + 1) * block_k)
        y_TN += (xq[:, cols] @ wq[:, cols].T) * x_scale_TG[:, kb, None] * w_scale_NG[None, :, kb]
    return y_TN.to(out_dtype)


def fused_moe_fp8_ref(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                      w13_E2FD_fp8: torch.Tensor, w13_scale: torch.Tensor, w2_EDF_fp8: torch.Tensor,
                      w2_scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """out_TD[t] = sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k], each
    projection a W8A8 block GEMM (w13_E2FD: gate rows [0, F), then up rows [F, 2F)); the intermediate is
    float32 until its own quantization; an id of -1 adds nothing. Sums in float32, one cast to x's dtype."""
    T, D = x_TD.shape
    F = w2_EDF_fp8.shape[2]
    _check(w13_E2FD_fp8.shape[1:] == (2 * F, D) and w2_EDF_fp8.shape[1:] == (D, F),
           f"w13 {tuple(w13_E2FD_fp8.shape)} and w2 {tuple(w2_EDF_fp8.shape)} must be [E, 2F, D] and [E, D, F]")
    out_TD = torch.zeros(T, D, dtype=torch.float32, device=x_TD.device)
    for t in range(T):
        for k in range(topk_ids_TK.shape[1]):
            e = int(topk_ids_TK[t, k])
            if e < 0:
                continue
            gate_up = w8a8_block_gemm_ref(x_TD[t:t + 1], w13_E2FD_fp8[e], w13_scale[e], block_n, block_k, torch.float32)
            act = F_.silu(gate_up[:, :F]) * gate_up[:, F:]
            down = w8a8_block_gemm_ref(act, w2_EDF_fp8[e], w2_scale[e], block_n, block_k, torch.float32)
            out_TD[t] += topk_weights_TK[t, k].float() * down[0]
    return out_TD.to(x_TD.dtype)
