"""DeepSeek-V3 shapes on one GPU: the MLA decode attention, and the engine's decode and prefill, against rooflines
computed from rates measured on the same machine in the same run.

    python benchmarks/deepseek_v3.py            # GPU: 4 layers of DeepSeek-V3's real widths (1 dense, 3 MoE), bf16
    python benchmarks/deepseek_v3.py --tiny     # CPU smoke run of the same code (tiny widths)
    python benchmarks/deepseek_v3.py --skip-attention --kv-cache-dtype fp8   # engine runs, e4m3 latent cache

attention: decode (one query a sequence) of 128 heads over the latent cache (576 values a token), batch 1 / 16 / 64
  x context 1k / 4k / 16k / 32k: the Triton kernel (moe_infer/kernels/mla_attention.py, its default tiles and
  candidates, the best reported) against the gathered-latent PyTorch path (rows gathered through the block table to
  [B, L, 576], bf16 matmuls, float32 softmax), both as a decode step's CUDA graph runs them (20 calls a graph, no
  host time); roofline = max(latent bytes / measured HBM copy rate, absorbed FLOPs / measured bf16 GEMM rate).
  Prompt attention: absorbed (the kernel) against up-projected (per-head keys and values, causal SDPA).
engine: a random-weight model (`model.load_format=dummy`) of DeepSeek-V3's widths cut to 4 layers (hidden 7168,
  128 heads, q-LoRA 1536, latent 512 + 64, 256 experts top-8 in 8 groups, expert F 2048, one shared expert; the
  first layer dense, F 18432): about 74 GB of bf16, and its fp8 (128 x 128 blocks) form. Decode: batch B, prompt
  128, 64 new tokens, output tok/s of the generate call against B x new tokens / (new tokens x bytes of one decode
  step / HBM rate), the bytes being every weight a step reads (the experts touched at B tokens under uniform routing,
  E (1 - (1 - K/E)^B): an estimate) and the latent cache. Prefill: 16 x 1024, prompt tok/s against
  max(FLOPs / bf16 GEMM rate, weights / HBM rate).
Writes JSON (device named) to --out, else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from device_rates import measure_rates  # noqa: E402
from e2e_generate import clock_in_graph, device_label, time_ours, write_result  # noqa: E402

REAL = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=1,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=4096, norm_topk_prob=True, num_nextn_predict_layers=0,
)
TINY = dict(REAL, vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
            topk_group=2, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
            max_position_embeddings=512)


# ---------------------------------------------------------------- attention
def gathered_latent_attention(q_BHC, cache_NbS1C, tables_BM, L: int, c: int, scale: float) -> torch.Tensor:
    """The PyTorch path: every sequence's L rows gathered through its block table, bf16 matmuls, float32 softmax."""
    S = cache_NbS1C.shape[1]
    keys_L = torch.arange(L, device=q_BHC.device)
    slots_BL = tables_BM.long()[:, keys_L // S] * S + keys_L % S
    rows_BLC = cache_NbS1C.view(-1, cache_NbS1C.shape[-1])[slots_BL]
    scores_BHL = torch.bmm(q_BHC, rows_BLC.transpose(1, 2)).float() * scale
    return torch.bmm(torch.softmax(scores_BHL, -1).to(q_BHC.dtype), rows_BLC[..., :c])


def candidates(device) -> list:
    """Tile configurations timed beside the default (heads, value columns, keys a tile, warps a program)."""
    from moe_infer.kernels.mla_attention import TileConfig, tile_config

    default = tile_config(True, device)
    if device.type != "cuda":
        return [default, TileConfig(block_h=4, block_v=16, block_n=16, warps=4)]
    return [default] + [TileConfig(block_h=h, block_v=v, block_n=n, warps=w) for h, v, n, w in (
        (32, 256, 32, 8), (64, 256, 16, 8), (32, 512, 16, 8))]


def bench_attention(dims: dict, batches, contexts, device, hbm: float, flops: float) -> list:
    from moe_infer.kernels.mla_attention import mla_attention_triton

    H, c, r = dims["num_attention_heads"], dims["kv_lora_rank"], dims["qk_rope_head_dim"]
    S, dtype, rows = 64, torch.bfloat16 if device.type == "cuda" else torch.float32, []
    scale = (dims["qk_nope_head_dim"] + r) ** -0.5
    for L in contexts:
        for B in batches:
            blocks = B * -(-L // S)
            cache = torch.randn(blocks, S, 1, c + r, device=device).to(dtype)
            tables_BM = torch.randperm(blocks, device=device, dtype=torch.int32).view(B, -1)
            q_BHC = torch.randn(B, H, c + r, device=device).to(dtype)
            seq_lens_B = torch.full((B,), L, dtype=torch.int32, device=device)
            starts_B1 = torch.arange(B + 1, dtype=torch.int32, device=device)
            args = (q_BHC, cache, c, tables_BM, seq_lens_B, starts_B1, scale, 1, L)
            tiles = {}
            for cfg in candidates(device):  # the default first
                tiles[str(cfg)] = clock_in_graph(lambda: mla_attention_triton(*args, config=cfg), device) * 1e6
            kernel_us = next(iter(tiles.values()))
            torch_s = clock_in_graph(lambda: gathered_latent_attention(q_BHC, cache, tables_BM, L, c, scale), device)
            got = mla_attention_triton(*args).float()
            want = gathered_latent_attention(q_BHC, cache, tables_BM, L, c, scale).float()
            # roofline: the latent rows read at the HBM rate, or the absorbed FLOPs (576-wide scores, 512-wide values)
            roof_s = max(B * L * (c + r) * cache.element_size() / hbm, 2 * B * H * L * (2 * c + r) / flops)
            rows.append(dict(batch=B, context=L, kernel_us=kernel_us, torch_us=torch_s * 1e6,
                             speedup=torch_s * 1e6 / kernel_us, roofline_us=roof_s * 1e6,
                             pct_roofline=roof_s * 1e6 / kernel_us, best_tiles=min(tiles, key=tiles.get),
                             best_us=min(tiles.values()), tiles_us=tiles, max_abs_diff=(got - want).abs().max().item()))
    return rows


def bench_prefill_attention(dims: dict, shapes, device, flops: float) -> list:
    """Prompt attention (no cached prefix) of `seqs` x `length` tokens, 128 heads, the two forms the issue names:
    absorbed (the Triton kernel over the latent rows: 576-wide scores, 512-wide values per head) against
    up-projected (per-head keys [W_UK c | k_rot] and values W_UV c computed from the latent, then causal SDPA over
    192-wide heads, the values padded to 192 for the flash kernels), each from the same latent rows and queries,
    the up-projection's and the absorption's GEMMs included; timed in CUDA graphs."""
    import torch.nn.functional as F

    from moe_infer.kernels.mla_attention import mla_attention_triton

    H, c, r = dims["num_attention_heads"], dims["kv_lora_rank"], dims["qk_rope_head_dim"]
    n, v = dims["qk_nope_head_dim"], dims["v_head_dim"]
    dtype, S, rows = torch.bfloat16 if device.type == "cuda" else torch.float32, 64, []
    scale = (n + r) ** -0.5
    w_uk_Hnc = (torch.randn(H, n, c, device=device) / c ** 0.5).to(dtype)
    w_uv_Hvc = (torch.randn(H, v, c, device=device) / c ** 0.5).to(dtype)
    for seqs, length in shapes:
        T = seqs * length
        lat_TC = torch.randn(T, c + r, device=device).to(dtype)  # the step's rows, also its cache
        cache = lat_TC.view(T // S, S, 1, c + r) if length % S == 0 else None
        q_nope_THn, q_rot_THr = torch.randn(T, H, n, device=device).to(dtype), torch.randn(T, H, r, device=device).to(dtype)
        tables_BM = torch.arange(T // S, device=device, dtype=torch.int32).view(seqs, -1)
        lens_B = torch.full((seqs,), length, dtype=torch.int32, device=device)
        starts_B1 = torch.arange(seqs + 1, dtype=torch.int32, device=device) * length

        def absorbed():
            q_lat_HTc = torch.bmm(q_nope_THn.transpose(0, 1), w_uk_Hnc)
            q_THC = torch.cat((q_lat_HTc.transpose(0, 1), q_rot_THr), -1)
            o_THc = mla_attention_triton(q_THC, cache, c, tables_BM, lens_B, starts_B1, scale, length, length)
            return torch.bmm(o_THc.transpose(0, 1), w_uv_Hvc.transpose(1, 2))

        def up_projected():
            c_Tc, k_rot_Tr = lat_TC[:, :c], lat_TC[:, c:]
            k_nope_HTn = torch.matmul(c_Tc, w_uk_Hnc.transpose(1, 2))  # [H, T, n]
            v_HTv = torch.matmul(c_Tc, w_uv_Hvc.transpose(1, 2))
            k_HTx = torch.cat((k_nope_HTn, k_rot_Tr.expand(H, T, r)), -1)
            q_HTx = torch.cat((q_nope_THn, q_rot_THr), -1).transpose(0, 1)
            v_pad = F.pad(v_HTv, (0, n + r - v))
            shape = lambda t: t.view(H, seqs, length, -1).transpose(0, 1)  # noqa: E731  [B, H, L, x]
            o = F.scaled_dot_product_attention(shape(q_HTx), shape(k_HTx), shape(v_pad), is_causal=True, scale=scale)
            return o[..., :v]

        if cache is None:
            continue
        a_s, u_s = clock_in_graph(absorbed, device, calls=3), clock_in_graph(up_projected, device, calls=3)
        a = absorbed().transpose(0, 1).float()  # [T, H, v]
        u = up_projected().transpose(1, 2).reshape(T, H, v).float()
        fl_abs = 2 * seqs * length * (length + 1) / 2 * H * (2 * c + r)
        rows.append(dict(seqs=seqs, length=length, absorbed_ms=a_s * 1e3, up_projected_ms=u_s * 1e3,
                         absorbed_tflops=fl_abs / a_s / 1e12, faster="absorbed" if a_s < u_s else "up_projected",
                         max_abs_diff=(a - u).abs().max().item()))
    return rows


# ---------------------------------------------------------------- engine
def layer_weights(dims: dict, moe: bool, experts_touched: float, elem: float = 2) -> float:
    """Bytes of one layer's weights a step reads; elem: bytes a quantizable weight (fp8: 1 + its block scales).
    kv_b_proj is read in bf16 either way (the absorbed form keeps it dequantized), the router in float32."""
    D, H, Q = dims["hidden_size"], dims["num_attention_heads"], dims["q_lora_rank"]
    c, r, n, v = dims["kv_lora_rank"], dims["qk_rope_head_dim"], dims["qk_nope_head_dim"], dims["v_head_dim"]
    attn = elem * (D * Q + Q * H * (n + r) + D * (c + r) + H * v * D) + 2 * c * H * (n + v)
    if not moe:
        return attn + elem * 3 * D * dims["intermediate_size"]
    F, E = dims["moe_intermediate_size"], dims["n_routed_experts"]
    return attn + elem * 3 * D * F * (dims["n_shared_experts"] + experts_touched) + 4 * D * E


def touched(dims: dict, tokens: int) -> float:
    E, K = dims["n_routed_experts"], dims["num_experts_per_tok"]
    return E * (1.0 - (1.0 - K / E) ** tokens)


def decode_step_bytes(dims: dict, batch: int, context: int, elem: float = 2) -> float:
    dense = dims["first_k_dense_replace"]
    moe = dims["num_hidden_layers"] - dense
    cache = dims["num_hidden_layers"] * batch * context * (dims["kv_lora_rank"] + dims["qk_rope_head_dim"]) * 2
    return (dense * layer_weights(dims, False, 0, elem) + moe * layer_weights(dims, True, touched(dims, batch), elem)
            + 2 * dims["vocab_size"] * dims["hidden_size"] + cache)


def prefill_limit_s(dims: dict, seqs: int, length: int, hbm: float, flops: float, elem: float = 2) -> float:
    """max(FLOPs at the bf16 GEMM rate, weights touched at the HBM rate) (fp8 GEMMs are held to the bf16 rate too)."""
    T, H, L = seqs * length, dims["num_attention_heads"], dims["num_hidden_layers"]
    dense, moe = dims["first_k_dense_replace"], L - dims["first_k_dense_replace"]
    active = (dense * layer_weights(dims, False, 0) + moe * layer_weights(dims, True, dims["num_experts_per_tok"])) / 2
    pairs = seqs * length * (length + 1) / 2  # causal (query, key) pairs; absorbed: 576-wide keys, 512-wide values
    fl = 2 * T * active + 2 * L * H * pairs * (2 * dims["kv_lora_rank"] + dims["qk_rope_head_dim"])
    weights = dense * layer_weights(dims, False, 0, elem) + moe * layer_weights(dims, True, touched(dims, T), elem)
    return max(fl / flops, weights / hbm)


def write_config(dims: dict, folder: str, fp8_block: int = 0) -> str:
    """config.json of the model (random weights are made at load); fp8_block: DeepSeek's fp8 release format."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(**dims, eos_token_id=0, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    if fp8_block:
        cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [fp8_block, fp8_block]}
    cfg.save_pretrained(folder)
    return folder


def bench_engine(dims: dict, batches, prompt: int, new: int, prefill, device, hbm: float, flops: float,
                 fp8_block: int = 0, kv_cache_dtype: str = "auto") -> dict:
    from moe_infer import LLM

    seqs, length = prefill
    folder = write_config(dims, tempfile.mkdtemp(prefix="deepseek_v3_"), fp8_block)
    elem = 1 + 4 / fp8_block ** 2 if fp8_block else 2  # fp8 bytes and their float32 block scales
    start = time.perf_counter()
    llm = LLM(model=folder, load_format="dummy", dtype="bfloat16" if device.type == "cuda" else "float32",
              device=str(device), max_num_seqs=max(batches + [seqs]), max_model_len=max(prompt + new, length + 1),
              max_num_batched_tokens=max(seqs * length // 4, 8), enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype)
    out = dict(startup_s=time.perf_counter() - start, decode=[], kv_bytes_per_token=llm.engine.runner.model
               .kv_cache_bytes_per_block(1))
    gen = torch.Generator().manual_seed(0)
    V = dims["vocab_size"]

    def run(b: int, n: int, tokens: int) -> float:  # greedy, EOS ignored, random prompt ids
        return time_ours(llm, torch.randint(2, V, (b, n), generator=gen).tolist(), tokens, device)[0]

    for b in batches:
        run(b, prompt, new)  # warm-up: graphs of this batch captured, kernels compiled
        secs = statistics.median(run(b, prompt, new) for _ in range(3))
        roof_s = sum(decode_step_bytes(dims, b, prompt + i, elem) for i in range(new)) / hbm
        out["decode"].append(dict(batch=b, tok_s=b * new / secs, roofline_tok_s=b * new / roof_s,
                                  pct_roofline=roof_s / secs))
    run(seqs, length, 1)
    secs = statistics.median(run(seqs, length, 1) for _ in range(3))
    limit = prefill_limit_s(dims, seqs, length, hbm, flops, elem)
    out["prefill"] = dict(seqs=seqs, length=length, tok_s=seqs * length / secs, limit_tok_s=seqs * length / limit,
                          pct_limit=limit / secs)
    graphs = llm.engine.runner.graphs
    out["decode_graphs"] = None if graphs is None else dict(replayed=graphs.runs, disabled=graphs.disabled)
    del llm
    if device.type == "cuda":
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (a smoke run)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-attention", action="store_true", help="only the engine runs")
    ap.add_argument("--formats", default="bf16,fp8", help="weight formats of the engine runs (bf16, fp8)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine runs' latent cache: auto (model dtype), fp8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dims = TINY if args.tiny else REAL
    rates = measure_rates(device)
    hbm, flops = rates["hbm_gbps"] * 1e9, rates["tflops"] * 1e12
    batches = [1, 2] if args.tiny else [1, 16, 64]
    contexts = [32, 64] if args.tiny else [1024, 4096, 16384, 32768]
    result = dict(device=device_label(device), rates=rates, dims=dims)
    if not args.skip_attention:
        result["attention"] = bench_attention(dims, batches, contexts, device, hbm, flops)
        result["prefill_attention"] = bench_prefill_attention(
            dims, [(1, 64), (2, 64)] if args.tiny else [(1, 1024), (16, 1024), (1, 8192)], device, flops)
    if not args.skip_engine:
        result["engine"] = {fmt: bench_engine(dims, batches, 8 if args.tiny else 128, 4 if args.tiny else 64,
                                              (2, 32) if args.tiny else (16, 1024), device, hbm, flops,
                                              fp8_block=(16 if args.tiny else 128) if fmt == "fp8" else 0,
                                              kv_cache_dtype=args.kv_cache_dtype)
                            for fmt in args.formats.split(",")}
        if {"bf16", "fp8"} <= set(result["engine"]):
            bf16, fp8 = ({d["batch"]: d["tok_s"] for d in result["engine"][f]["decode"]} for f in ("bf16", "fp8"))
            result["fp8_decode_speedup"] = {b: fp8[b] / bf16[b] for b in bf16}
    print_table(result)
    write_result(result, f"deepseek_v3_{result['device']}{'_tiny' if args.tiny else ''}.json", args.out)


def print_table(result: dict) -> None:
    r = result["rates"]
    print(f"\n{result['device']}: HBM copy {r['hbm_gbps']:.0f} GB/s, bf16 GEMM {r['tflops']:.1f} TFLOPS "
          f"({r.get('note', 'measured in this run')})")
    print(f"\nMLA decode attention, {result['dims']['num_attention_heads']} heads (us)\n"
          f" batch context   kernel    torch  speedup  roofline  %roof  max|diff|  best tiles (us)")
    for a in result.get("attention", []):
        print(f"{a['batch']:>6} {a['context']:>7} {a['kernel_us']:>8.1f} {a['torch_us']:>8.1f} {a['speedup']:>7.2f}x "
              f"{a['roofline_us']:>9.1f} {a['pct_roofline']:>6.0%} {a['max_abs_diff']:>10.2e}  {a['best_us']:.1f} "
              f"{a['best_tiles']}")
    print("\nMLA prompt attention (ms): absorbed (Triton) vs up-projected (SDPA)")
    for p in result.get("prefill_attention", []):
        print(f"  {p['seqs']} x {p['length']}: absorbed {p['absorbed_ms']:.2f} ({p['absorbed_tflops']:.0f} TFLOPS), "
              f"up-projected {p['up_projected_ms']:.2f}; faster: {p['faster']} (max |diff| {p['max_abs_diff']:.1e})")
    for fmt, eng in (result.get("engine") or {}).items():
        print(f"\nengine, {fmt} weights (start-up {eng['startup_s']:.0f} s, KV {eng['kv_bytes_per_token']} bytes a "
              f"token)\n batch    tok/s  roofline  %roof")
        for d in eng["decode"]:
            print(f"{d['batch']:>6} {d['tok_s']:>8.0f} {d['roofline_tok_s']:>9.0f} {d['pct_roofline']:>6.0%}")
        p = eng["prefill"]
        print(f"prefill {p['seqs']}x{p['length']}: {p['tok_s']:.0f} tok/s, limit {p['limit_tok_s']:.0f} "
              f"({p['pct_limit']:.0%})")
    if "fp8_decode_speedup" in result:
        print("fp8 / bf16 decode: " + ", ".join(f"batch {b} {s:.2f}x" for b, s in result["fp8_decode_speedup"].items()))


if __name__ == "__main__":
    main()
