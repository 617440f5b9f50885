"""MLA attention in the absorbed form (moe_infer/layers/mla.py): the reference backend and the Triton kernel
(interpreter on CPU, CUDA with `-m gpu`) against attention with per-head keys and values up-projected from the
latent, computed sequence by sequence (what transformers' DeepSeek attention does), over a paged latent cache
(NaN where never written, shuffled blocks), in decode, prefill and mixed steps, with and without split keys."""
import os

import pytest
import torch

from moe_infer.layers.forward_context import AttentionMetadata
from moe_infer.layers.mla import mla_attend_torch
from moe_infer.layers.paged_attention import store_rows

pytestmark = pytest.mark.timeout(300)

MIXED, DECODE, PREFILL = [1, 7, 2, 4], [1, 1, 1, 1], [3, 7, 2, 4]  # this step's tokens per sequence


def _triton(splits=None):
    def attend(q, cache, c, attn, positions, scale):
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
        from moe_infer.kernels.mla_attention import mla_attention_triton

        return mla_attention_triton(q, cache, c, attn.block_tables_BM, attn.seq_lens_B, attn.query_start_loc_B1,
                                    scale, attn.max_query_len, attn.max_seq_len, splits=splits)
    attend.__name__ = f"triton_split{splits}"
    return attend


ATTENDS = [mla_attend_torch, _triton(), _triton(2), _triton(4)]


def _case(new, cached=(5, 0, 11, 3), H=4, c=32, r=8, n=16, v=12, S=4, Nb=40, dtype=torch.float32,
          device="cpu", seed=0, parts=False):
    """(absorbed queries [T, H, c + r], cache, metadata, W_UV [H, v, c], scale, the up-projected reference
    output [T, H, v]); parts: and (q_nope [T, H, n], q_rot [T, H, r], W_UK [H, n, c])."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    w_uk, w_uv = rand(H, n, c) / c ** 0.5, rand(H, v, c) / c ** 0.5
    cache = torch.full((Nb, S, 1, c + r), float("nan"))
    free = torch.randperm(Nb, generator=g).tolist()
    tables, q_abs, ref, slots, starts, lens, q_parts = [], [], [], [], [0], [], []
    scale = (n + r) ** -0.5
    for ctx, m in zip(cached, new):
        L = ctx + m
        blocks = [free.pop() for _ in range(-(-L // S))]
        tables.append(blocks)
        lat, k_rot = rand(L, c), rand(L, r)
        seq_slots = torch.tensor([blocks[p // S] * S + p % S for p in range(L)])
        store_rows(torch.cat((lat, k_rot), -1)[:, None].to(dtype), cache, seq_slots)  # dtype rounding, then back
        lat_q, rot_q = (cache.view(-1, c + r)[seq_slots].float().split([c, r], -1))
        q_nope, q_rot = rand(m, H, n), rand(m, H, r)
        # the reference: per-head K = [W_UK c_j | k_rot_j], V = W_UV c_j, causal over positions 0..L-1
        k_LHx = torch.cat((torch.einsum("hnc,lc->lhn", w_uk, lat_q), rot_q[:, None].expand(L, H, r)), -1)
        v_LHv = torch.einsum("hvc,lc->lhv", w_uv, lat_q)
        s = torch.einsum("qhx,lhx->hql", torch.cat((q_nope, q_rot), -1), k_LHx) * scale
        visible = torch.arange(L)[None, :] <= torch.arange(ctx, L)[:, None]
        ref.append(torch.einsum("hql,lhv->qhv", torch.softmax(s.masked_fill(~visible, float("-inf")), -1), v_LHv))
        q_abs.append(torch.cat((torch.einsum("qhn,hnc->qhc", q_nope, w_uk), q_rot), -1))
        q_parts.append((q_nope, q_rot))
        slots += seq_slots[ctx:].tolist()
        starts.append(starts[-1] + m)
        lens.append(L)
    M = max(len(t) for t in tables)
    dev = torch.device(device)
    attn = AttentionMetadata(
        positions_T=torch.cat([torch.arange(ctx, ctx + m) for ctx, m in zip(cached, new)]).to(dev),
        slot_mapping_T=torch.tensor(slots, device=dev),
        block_tables_BM=torch.tensor([t + [-1] * (M - len(t)) for t in tables], dtype=torch.int32, device=dev),
        query_start_loc_B1=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens_B=torch.tensor(lens, dtype=torch.int32, device=dev), max_query_len=max(new), max_seq_len=max(lens),
        block_size=S)
    out = (torch.cat(q_abs).to(dtype).to(dev), cache.to(dtype).to(dev), attn, w_uv.to(dev), scale,
           torch.cat(ref).to(dev))
    if parts:
        out += (torch.cat([p[0] for p in q_parts]).to(dtype).to(dev), torch.cat([p[1] for p in q_parts]).to(dtype)
                .to(dev), w_uk.to(dtype).to(dev))
    return out


@pytest.mark.parametrize("new", [MIXED, DECODE, PREFILL], ids=["mixed", "decode", "prefill"])
@pytest.mark.parametrize("attend", ATTENDS, ids=lambda f: f.__name__)
def test_absorbed_attention_matches_up_projected(new, attend):
    q, cache, attn, w_uv, scale, ref = _case(new)
    o_lat = attend(q, cache, 32, attn, attn.positions_T, scale)
    assert o_lat.shape == (sum(new), 4, 32) and o_lat.dtype == q.dtype
    out = torch.einsum("thc,hvc->thv", o_lat.float(), w_uv)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("new", [MIXED, PREFILL], ids=["mixed", "prefill"])
def test_up_projected_prompt_attention_matches(new):
    """The up-projected form of the Triton backend (per-head K/V from the latent rows, the paged MHA kernel) gives
    the reference's output, from a cached prefix on, beside decode rows."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
    from moe_infer.layers.mla_triton import up_projected_prompt_attention

    _, cache, attn, w_uv, scale, ref, q_nope, q_rot, w_uk = _case(new, parts=True)
    out = up_projected_prompt_attention(q_nope, q_rot, cache, w_uk, w_uv, attn, scale)
    torch.testing.assert_close(out.float(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_triton_split_keys_over_long_contexts(splits):
    q, cache, attn, w_uv, scale, ref = _case([1, 1, 1], cached=(37, 60, 5), Nb=64)
    out = torch.einsum("thc,hvc->thv", _triton(splits)(q, cache, 32, attn, attn.positions_T, scale).float(), w_uv)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_triton_in_bf16_is_close_to_the_reference():
    q, cache, attn, _, scale, _ = _case(MIXED, dtype=torch.bfloat16)
    want = mla_attend_torch(q, cache, 32, attn, attn.positions_T, scale).float()
    got = _triton()(q, cache, 32, attn, attn.positions_T, scale).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_bad_shapes_raise():
    pytest.importorskip("triton")
    from moe_infer.kernels.mla_attention import mla_attention_triton

    q, cache, attn, *_ = _case(DECODE)
    args = (attn.block_tables_BM, attn.seq_lens_B, attn.query_start_loc_B1, 1.0, 1, attn.max_seq_len)
    with pytest.raises(ValueError, match="does not fit the latent cache"):
        mla_attention_triton(q[..., :-1], cache, 32, *args)
    with pytest.raises(ValueError, match="does not fit the latent cache"):
        mla_attention_triton(q, cache, 40, *args)
    with pytest.raises(ValueError, match="q is torch.bfloat16"):
        mla_attention_triton(q.bfloat16(), cache, 32, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("new,cached", [
    ([1] * 8, (700, 3, 2047, 64, 1, 129, 4096, 17)),  # decodes: split keys where the programs are few
    ([1, 200, 3, 64], (300, 0, 17, 1000)),  # prompt chunks beside a decode
])
def test_triton_matches_reference_gpu(dtype, new, cached):
    """DeepSeek-V3's widths (latent 512, rotary 64, 16 heads of one tensor-parallel share) on the GPU."""
    q, cache, attn, w_uv, scale, ref = _case(new, cached, H=16, c=512, r=64, n=128, v=128, S=16, Nb=1024,
                                             dtype=dtype, device="cuda")
    want = mla_attend_torch(q, cache, 512, attn, attn.positions_T, scale).float()
    got = _triton()(q, cache, 512, attn, attn.positions_T, scale).float()
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(torch.einsum("thc,hvc->thv", got, w_uv), ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_engine_tokens_equal_through_the_triton_kernel(family, monkeypatch):
    """The engine on a DeepSeek checkpoint with the Triton MLA kernel (interpreter on CPU) gives the greedy tokens
    of the reference backend, over chunked prefill (the up-projected form for prompt steps), mixed steps and
    decodes (the absorbed kernel)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
    from engine_fixtures import checkpoint
    from moe_infer import LLM, SamplingParams
    from moe_infer.plugins import load_plugins

    load_plugins()
    from moe_infer.layers import mla_triton

    up_calls = []
    real = mla_triton.mla_attend_triton.prompt
    monkeypatch.setattr(mla_triton.mla_attend_triton, "prompt", lambda *a: up_calls.append(1) or real(*a))
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [40, 41, 42], [7, 7, 8, 8, 9, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=checkpoint(family), dtype="float32", device="cpu", block_size=4, attention_backend=backend,
                  num_kv_blocks=32, max_num_batched_tokens=8, enable_prefix_caching=False)
        layers = [llm.engine.runner.model.layers[i].self_attn for i in llm.engine.runner.model.local_layers]
        assert all(attn.backend == backend for attn in layers)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.scheduler.num_chunked_prefills > 0
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["triton"] == tokens["torch"]
    assert up_calls  # prompt steps took the up-projected form


@pytest.mark.parametrize("block_v", [16, 32])
@pytest.mark.parametrize("new", [MIXED, DECODE], ids=["mixed", "decode"])
def test_triton_value_split_over_programs(new, block_v):
    """The value accumulator in parts of block_v latent columns (one program each): the same output."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
    from moe_infer.kernels.mla_attention import TileConfig, mla_attention_triton

    q, cache, attn, w_uv, scale, ref = _case(new)
    for splits in (1, 2):
        o_lat = mla_attention_triton(q, cache, 32, attn.block_tables_BM, attn.seq_lens_B, attn.query_start_loc_B1,
                                     scale, attn.max_query_len, attn.max_seq_len, splits=splits if new == DECODE else 1,
                                     config=TileConfig(block_h=2, block_v=block_v, block_n=16, warps=4, block_q=2))
        torch.testing.assert_close(torch.einsum("thc,hvc->thv", o_lat.float(), w_uv), ref, atol=1e-4, rtol=1e-4)


FP8 = torch.float8_e4m3fn


def _fp8_cache(cache, kv_scale):
    """The latent cache in e4m3 (rows / kv_scale) and its values dequantized in float32."""
    cache8 = (cache.float() / kv_scale).to(FP8)
    return cache8, cache8.float() * kv_scale


@pytest.mark.parametrize("new", [MIXED, DECODE, PREFILL], ids=["mixed", "decode", "prefill"])
@pytest.mark.parametrize("attend", [mla_attend_torch, _triton(), _triton(2)], ids=lambda f: f.__name__)
def test_fp8_latent_cache_reads_as_its_dequantized_values(new, attend):
    """An e4m3 latent cache with kv_scale 0.75: the reference and the kernel (scale folded into the scores and the
    output) give the reference's output over the dequantized float32 cache, up to float32 order; and the result
    stays within e4m3's rounding of the unquantized cache's (attention averages the values' 2^-4 steps)."""
    q, cache, attn, w_uv, scale, ref = _case(new)
    kv_scale = torch.tensor([0.75])
    cache8, deq = _fp8_cache(cache, kv_scale)
    want = mla_attend_torch(q, deq, 32, attn, attn.positions_T, scale)
    if attend is mla_attend_torch:
        got = attend(q, cache8, 32, attn, attn.positions_T, scale, kv_scale=kv_scale)
    else:
        from moe_infer.kernels.mla_attention import mla_attention_triton

        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
        splits = 2 if attend.__name__.endswith("2") else None
        got = mla_attention_triton(q, cache8, 32, attn.block_tables_BM, attn.seq_lens_B, attn.query_start_loc_B1,
                                   scale, attn.max_query_len, attn.max_seq_len, splits=splits, kv_scale=kv_scale)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    out = torch.einsum("thc,hvc->thv", got.float(), w_uv)
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.1)


def test_fp8_latent_cache_up_projected_and_refusals():
    """The up-projected prompt form reads an e4m3 cache dequantized (times kv_scale); the kernel refuses an fp8
    cache without a float32 [1] kv_scale."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
    from moe_infer.kernels.mla_attention import mla_attention_triton
    from moe_infer.layers.mla_triton import up_projected_prompt_attention

    q, cache, attn, w_uv, scale, ref, q_nope, q_rot, w_uk = _case(MIXED, parts=True)
    kv_scale = torch.tensor([1.25])
    cache8, deq = _fp8_cache(cache, kv_scale)
    got = up_projected_prompt_attention(q_nope, q_rot, cache8, w_uk, w_uv, attn, scale, kv_scale=kv_scale)
    want = up_projected_prompt_attention(q_nope, q_rot, deq, w_uk, w_uv, attn, scale)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    args = (q, cache8, 32, attn.block_tables_BM, attn.seq_lens_B, attn.query_start_loc_B1, scale, attn.max_query_len,
            attn.max_seq_len)
    for bad in (None, torch.tensor([1.0, 1.0]), torch.tensor([1.0], dtype=torch.float64)):
        with pytest.raises(ValueError, match="kv_scale float32"):
            mla_attention_triton(*args, kv_scale=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("new,cached", [([1] * 8, (4000, 17, 900, 1, 2047, 64, 333, 1500)), ([1, 300, 1, 77],
                                                                                            (1500, 0, 31, 2000))])
def test_fp8_latent_cache_gpu(new, cached):
    """DeepSeek-V3's latent row (512 + 64), 128 heads, bf16 queries over an e4m3 cache (kv_scale 0.5), against the
    float32 reference on the same cache (the bf16 tolerance of the other GPU tests)."""
    from moe_infer.kernels.mla_attention import mla_attention_triton

    Nb = sum(-(-(c + n) // 16) for c, n in zip(cached, new)) + 8
    q, cache, attn, _, scale, _ = _case(new, cached, H=128, c=512, r=64, n=128, v=128, S=16, Nb=Nb,
                                        dtype=torch.bfloat16, device="cuda")
    kv_scale = torch.tensor([0.5], device="cuda")
    cache8 = (cache.float() / kv_scale).to(FP8)
    got = mla_attention_triton(q, cache8, 512, attn.block_tables_BM, attn.seq_lens_B, attn.query_start_loc_B1, scale,
                               attn.max_query_len, attn.max_seq_len, kv_scale=kv_scale).float()
    want = mla_attend_torch(q, cache8, 512, attn, attn.positions_T, scale, kv_scale=kv_scale).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
