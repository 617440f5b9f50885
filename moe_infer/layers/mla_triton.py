"""MLA_BACKENDS["triton"]: the absorbed queries attended by the Triton kernel that reads the latent cache in place
(`moe_infer.kernels.mla_attention`). A plugin module (`moe_infer.plugins`): it imports triton, so it registers only
where triton is installed. Its queries and output are in the model dtype (the absorbed products then run as the
model's GEMMs), where the reference backend ("torch") computes them in float32."""
import torch

from moe_infer.kernels.mla_attention import mla_attention_triton
from moe_infer.layers.forward_context import AttentionMetadata
from moe_infer.layers.mla import MLA_BACKENDS


def mla_attend_triton(q_THC: torch.Tensor, cache_NbS1C: torch.Tensor, kv_lora_rank: int, attn: AttentionMetadata,
                      positions_T: torch.Tensor, scale: float) -> torch.Tensor:
    return mla_attention_triton(q_THC, cache_NbS1C, kv_lora_rank, attn.block_tables_BM, attn.seq_lens_B,
                                attn.query_start_loc_B1, scale, attn.max_query_len, attn.max_seq_len)


mla_attend_triton.compute_dtype = None  # the model dtype
mla_attend_triton.static_launch = True  # launch parameters from shapes and host ints: CUDA-graph capturable


def _decode_variant(batch: int, num_heads: int, max_seq_len: int, device: torch.device):
    from moe_infer.kernels.mla_attention import decode_splits

    return decode_splits(batch, num_heads, max_seq_len, device)


mla_attend_triton.decode_variant = _decode_variant
MLA_BACKENDS.register("triton")(mla_attend_triton)
