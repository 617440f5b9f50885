"""MLA_BACKENDS["triton"]: the absorbed queries attended by the Triton kernel that reads the latent cache in place
(`moe_infer.kernels.mla_attention`). A plugin module (`moe_infer.plugins`): it imports triton, so it registers only
where triton is installed. Its queries and output are in the model dtype (the absorbed products then run as the
model's GEMMs), where the reference backend ("torch") computes them in float32."""
from typing import Optional

import torch

from moe_infer.kernels.mla_attention import mla_attention_triton
from moe_infer.layers.forward_context import AttentionMetadata
from moe_infer.layers.mla import MLA_BACKENDS


def mla_attend_triton(q_THC: torch.Tensor, cache_NbS1C: torch.Tensor, kv_lora_rank: int, attn: AttentionMetadata,
                      positions_T: torch.Tensor, scale: float, kv_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return mla_attention_triton(q_THC, cache_NbS1C, kv_lora_rank, attn.block_tables_BM, attn.seq_lens_B,
                                attn.query_start_loc_B1, scale, attn.max_query_len, attn.max_seq_len,
                                kv_scale=kv_scale)


mla_attend_triton.compute_dtype = None  # the model dtype
mla_attend_triton.static_launch = True  # launch parameters from shapes and host ints: CUDA-graph capturable


def _decode_variant(batch: int, num_heads: int, max_seq_len: int, device: torch.device):
    from moe_infer.kernels.mla_attention import decode_splits

    return decode_splits(batch, num_heads, max_seq_len, device)


mla_attend_triton.decode_variant = _decode_variant
MLA_BACKENDS.register("triton")(mla_attend_triton)


def up_projected_prompt_attention(q_nope_THn: torch.Tensor, q_rot_THr: torch.Tensor, cache_NbS1C: torch.Tensor,
                                  w_uk_Hnc: torch.Tensor, w_uv_Hvc: torch.Tensor, attn: AttentionMetadata,
                                  scale: float, kv_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of a step with prompt chunks in the up-projected form -> [T, H, v]: every row of the step's blocks
    (B x M blocks of S rows, read through its block tables) up-projected to per-head keys [W_UK c | k_rot] and values
    W_UV c (padded to the key width), laid out as a paged per-head cache of its own (sequence b's blocks at
    b * M ...), attended by the paged MHA kernel (causal from each sequence's cached prefix on). Measured 6-16x
    faster than the absorbed kernel for 1k-8k-token prompts of DeepSeek-V3's heads on an H200
    (benchmarks/deepseek_v3.py): per query and key it multiplies 192 + 128 values per head, not 576 + 512. An fp8
    cache's rows are dequantized (times kv_scale) as they are gathered."""
    from moe_infer.kernels.paged_attention import paged_attention_triton

    B, M = attn.block_tables_BM.shape
    Nb, S, _, C = cache_NbS1C.shape
    H, n, c = w_uk_Hnc.shape
    v, r = w_uv_Hvc.shape[1], C - c
    X = B * M * S
    blocks = attn.block_tables_BM.long().clamp_min(0).view(-1)
    dtype = q_nope_THn.dtype
    if cache_NbS1C.dtype == torch.float8_e4m3fn:  # gathered as bytes, then its values times the scale
        rows_XC = cache_NbS1C.view(torch.uint8).view(Nb, S, C)[blocks].view(X, C).view(torch.float8_e4m3fn)
        rows_XC = (rows_XC.float() * kv_scale.float()).to(dtype)
    else:
        rows_XC = cache_NbS1C.view(Nb, S, C)[blocks].view(X, C)
    c_Xc = rows_XC[:, :c].to(dtype)
    k_XHd = torch.empty(X, H, n + r, dtype=dtype, device=rows_XC.device)
    k_XHd[..., :n] = torch.matmul(c_Xc, w_uk_Hnc.transpose(1, 2)).transpose(0, 1)
    k_XHd[..., n:] = rows_XC[:, None, c:].to(dtype)
    v_XHd = torch.zeros_like(k_XHd)
    v_XHd[..., :v] = torch.matmul(c_Xc, w_uv_Hvc.transpose(1, 2)).transpose(0, 1)
    tables_BM = torch.arange(B * M, dtype=torch.int32, device=rows_XC.device).view(B, M)
    q_THd = torch.cat((q_nope_THn, q_rot_THr), dim=-1)
    out_THd = paged_attention_triton(q_THd, k_XHd.view(B * M, S, H, n + r), v_XHd.view(B * M, S, H, n + r), tables_BM,
                                     attn.seq_lens_B, attn.query_start_loc_B1, attn.positions_T, scale,
                                     attn.max_query_len, attn.max_seq_len)
    return out_THd[..., :v]


mla_attend_triton.prompt = up_projected_prompt_attention
