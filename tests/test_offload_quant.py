"""Quantized experts in the offload tiers: an fp8 block-scaled checkpoint (tests/fp8_ckpt.py) offloaded to the
CPU and NVMe tiers gives the resident fp8 engine's greedy tokens on the same checkpoint; the tiers and the slot
pool hold the stored format (fp8 data and float32 scales, never a dequantized copy), the budget counts its bytes,
and the host's compute of a missed expert dequantizes that expert with its own scales. The same for the 4-bit
formats: int4 (a bf16 checkpoint quantized at load, groups of 32) and mxfp4 (GPT-OSS's quantization_config on a
Qwen3-MoE config, dummy weights: the same values whatever the store).
"""
from __future__ import annotations

import pytest
import torch

from fp8_ckpt import make_fp8_pair
from moe_infer import LLM, SamplingParams
from tiny_hf import make_tiny_checkpoint

FP8 = torch.float8_e4m3fn
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [40, 41, 42], [7, 7, 8, 8, 9, 9, 10, 10, 11, 12, 13]]
NUM_NEW = 10
KW = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=48, max_num_batched_tokens=16)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE in fp8 (16 x 16 blocks; experts of D 64 x F 32) and the resident engine's tokens on it."""
    tmp = tmp_path_factory.mktemp("fp8")
    src = make_tiny_checkpoint("qwen3_moe", tmp / "src", seed=3, per_expert_names=True, head_dim=16,
                               moe_intermediate_size=32, intermediate_size=80)
    fp8_dir, _ = make_fp8_pair(src, str(tmp / "fp8"), str(tmp / "ref"))
    llm = LLM(model=fp8_dir, **KW)
    assert llm.engine.runner.model.moe_layers()[0].store.w13_E2FD.dtype == FP8
    return fp8_dir, _generate(llm)


def _generate(llm, max_tokens: int = NUM_NEW) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


CASES = {
    "cpu_wait_prefetch": dict(offload="cpu", slots_per_layer=2, miss_policy="wait"),
    "cpu_misses_no_prefetch": dict(offload="cpu", slots_per_layer=1, miss_policy="cpu", prefetch=False),
    "cpu_streaming": dict(offload="cpu", slots_per_layer=2, stream_fraction=0.25, miss_policy="wait"),
    "cpu_share_refused_to_whole": dict(offload="cpu", slots_per_layer=2, miss_policy="share"),
    "nvme_prefetch": dict(offload="nvme", nvme_reader="threads", slots_per_layer=2, miss_policy="auto"),
    "nvme_no_prefetch": dict(offload="nvme", nvme_reader="threads", slots_per_layer=1, miss_policy="wait",
                             prefetch=False),
    "nvme_cpu_misses": dict(offload="nvme", nvme_reader="threads", slots_per_layer=1, miss_policy="cpu"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_offloaded_equals_resident(case, fp8_checkpoint, tmp_path):
    fp8_dir, want = fp8_checkpoint
    offload = CASES[case]
    if offload["offload"] == "nvme":
        offload = dict(offload, nvme_path=str(tmp_path))
    llm = LLM(model=fp8_dir, **KW, **offload)
    store = llm.engine.runner.model.moe_layers()[0].store
    assert store.w13_S2FD.dtype == FP8 and store.w13_S2FD.quant.scale_inv is store.slots["w13_scale_inv"]
    assert _generate(llm) == want
    total = llm.get_offload_stats()["total"]
    if offload.get("miss_policy") == "cpu":  # every miss computed on the host, from its dequantized expert
        assert total["cpu"] == total["needed"] - total["hits"] > 0 and total["copied"] == 0, str(total)
    else:
        assert total["needed"] > total["hits"] > 0, str(total)  # a cache smaller than the experts
    if offload.get("stream_fraction"):
        assert total["streamed"] > 0, str(total)
    if offload.get("prefetch", True):
        assert total["prefetched"] > 0, str(total)
    assert total["shared"] == 0  # quantized experts move whole
    if offload["offload"] == "nvme":
        assert total["gb_read"] > 0
    llm.shutdown()


W4_CASES = ("cpu_wait_prefetch", "cpu_misses_no_prefetch", "cpu_streaming", "nvme_prefetch", "nvme_cpu_misses")
W4_POOL = {  # one expert's tensors (D 64, F 32) in the slot pool: name -> (dtype, shape); int4 groups of 32
    "int4": {"w13": (torch.int32, (64, 8)), "w13_scale": (torch.float32, (64, 2)),
             "w2": (torch.int32, (64, 4)), "w2_scale": (torch.float32, (64, 1))},
    "mxfp4": {"w13": (torch.uint8, (64, 32)), "w13_scales": (torch.uint8, (64, 2)),
              "w2": (torch.uint8, (64, 16)), "w2_scales": (torch.uint8, (64, 1))},
}


@pytest.fixture(scope="module")
def w4_models(tmp_path_factory):
    """format -> (LLM kwargs of the tiny 4-bit model, the resident engine's tokens on it)."""
    import json
    import shutil

    tmp = tmp_path_factory.mktemp("w4")
    src = make_tiny_checkpoint("qwen3_moe", tmp / "src", seed=3, per_expert_names=True, head_dim=16,
                               moe_intermediate_size=32, intermediate_size=80)
    mx = tmp / "mxfp4"
    shutil.copytree(src, mx)
    cfg = json.loads((mx / "config.json").read_text())
    (mx / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "mxfp4"})))
    out = {}
    for fmt, kw in (("int4", dict(model=src, quantization="int4")), ("mxfp4", dict(model=str(mx),
                                                                                   load_format="dummy"))):
        llm = LLM(**kw, **KW)
        assert llm.engine.runner.model.moe_layers()[0].store.w13_E2FD.quant.fmt == fmt
        out[fmt] = kw, _generate(llm)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", W4_CASES)
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_w4_offloaded_equals_resident(fmt, case, w4_models, tmp_path):
    """int4 / mxfp4 experts offloaded: the tiers and the slot pool hold the packed data and scales (no dequantized
    copy), the budget counts those bytes, the host dequantizes a missed expert for its call; the resident tokens."""
    kw, want = w4_models[fmt]
    offload = CASES[case]
    if offload["offload"] == "nvme":
        offload = dict(offload, nvme_path=str(tmp_path))
    llm = LLM(**kw, **KW, **offload)
    m = llm.engine.runner.offload
    store = m.stores[0]
    S = m.plan.slots_per_layer[0]
    assert {n: (t.dtype, tuple(t.shape[1:])) for n, t in store.slots.items()} == W4_POOL[fmt]
    assert store.w13_S2FD is store.slots["w13"] and store.w2_SDF.quant.scale is store.slots[list(W4_POOL[fmt])[3]]
    assert m.shape.nbytes == sum(torch.Size(s).numel() * d.itemsize for d, s in W4_POOL[fmt].values())
    assert m.plan.device_bytes >= S * m.shape.nbytes
    assert _generate(llm) == want
    total = llm.get_offload_stats()["total"]
    if offload.get("miss_policy") == "cpu":
        assert total["cpu"] == total["needed"] - total["hits"] > 0 and total["copied"] == 0, str(total)
    else:
        assert total["needed"] > total["hits"] > 0, str(total)
    if offload.get("stream_fraction"):
        assert total["streamed"] > 0, str(total)
    llm.shutdown()


@pytest.mark.timeout(300)
def test_fp8_kernel_on_the_slot_pool_equals_resident(fp8_checkpoint, monkeypatch):
    """The W8A8 grouped kernel (Triton; the interpreter on CPU) on the slot pool and the stream buffers ([S, ...]
    fp8 weights with their [S, ...] scales, slot ids) gives the resident W8A8 engine's greedy tokens."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":  # CUDA: test_fp8_offloaded_on_cuda_equals_resident
        pytest.skip("the CPU run of the Triton kernels needs TRITON_INTERPRET=1")
    from moe_infer.kernels import fused_moe_fp8 as kernel

    fp8_dir, _ = fp8_checkpoint
    kw = dict(KW, experts_backend="triton")
    calls, real = [], kernel.fused_moe_fp8
    monkeypatch.setattr(kernel, "fused_moe_fp8", lambda x, ids, w, w13, *a: calls.append(w13.shape[0])
                        or real(x, ids, w, w13, *a))
    want = _generate(LLM(model=fp8_dir, **kw), max_tokens=6)
    assert set(calls) == {8}  # the resident experts
    calls.clear()
    llm = LLM(model=fp8_dir, **kw, offload="cpu", slots_per_layer=2, miss_policy="wait")
    assert _generate(llm, max_tokens=6) == want
    assert set(calls) == {1, 2}  # the 2-slot pool, and the 1-expert stream buffers of the prefills
    total = llm.get_offload_stats()["total"]
    assert total["needed"] > total["hits"] > 0 and total["streamed"] > 0, str(total)
    llm.shutdown()


@pytest.mark.timeout(120)
def test_slot_pool_and_budget_count_the_quantized_bytes(fp8_checkpoint):
    """Every tier holds the stored format: fp8 data and float32 scales per expert (no bf16/fp32 copy of any
    expert anywhere in the store), and a GiB budget buys experts at their quantized size."""
    fp8_dir, _ = fp8_checkpoint
    llm = LLM(model=fp8_dir, **KW, offload="cpu", slots_per_layer=3)
    m = llm.engine.runner.offload
    D, F, blk = m.shape.hidden_size, m.shape.intermediate_size, 16
    assert (D, F) == (64, 32)
    fp8_bytes = 3 * F * D + 4 * (2 * F // blk * D // blk + D // blk * F // blk)  # data + float32 scales
    dense_bytes = 3 * F * D * 4  # the same expert in float32
    assert m.shape.nbytes == fp8_bytes
    store = m.stores[0]
    slot_bytes = sum(t.numel() * t.element_size() for t in store.slots.values())
    assert slot_bytes == 3 * fp8_bytes
    held = {n: (t.dtype, tuple(t.shape)) for n, t in store.named_buffers()} | \
        {n: (p.dtype, tuple(p.shape)) for n, p in store.named_parameters()}
    E = store.num_local_experts
    assert held == {"w13_E2FD": (FP8, (E, 2 * F, D)),
                    "w13_E2FD_scale_inv": (torch.float32, (E, 2 * F // blk, D // blk)),
                    "w2_EDF": (FP8, (E, D, F)), "w2_EDF_scale_inv": (torch.float32, (E, D // blk, F // blk))}
    pool = {n: (t.dtype, tuple(t.shape)) for n, t in store.slots.items()}
    assert pool == {"w13": (FP8, (3, 2 * F, D)), "w13_scale_inv": (torch.float32, (3, 2 * F // blk, D // blk)),
                    "w2": (FP8, (3, D, F)), "w2_scale_inv": (torch.float32, (3, D // blk, F // blk))}
    assert store.w13_S2FD is store.slots["w13"] and store.w2_SDF.quant.scale_inv is store.slots["w2_scale_inv"]
    assert store._region.nbytes < E * dense_bytes / 3  # the host tier: the stored bytes (and alignment)
    llm.shutdown()
    budget_experts = 14  # a GiB budget: the experts it buys are counted at the quantized size
    llm = LLM(model=fp8_dir, **KW, offload="cpu", gpu_expert_budget_gb=budget_experts * fp8_bytes / 2**30)
    m = llm.engine.runner.offload
    assert sum(m.plan.slots_per_layer) + 2 * m.plan.stream_chunk == budget_experts
    assert m.plan.device_bytes == budget_experts * fp8_bytes
    llm.shutdown()


@pytest.mark.timeout(120)
def test_cpu_compute_dequantizes_the_routed_expert(fp8_checkpoint):
    """The host's compute of a missed expert reads that expert's data with that expert's scale rows: equal to
    the expert dequantized by hand from the checkpoint's own tensors (a naive per-element loop over blocks)."""
    from safetensors.torch import load_file

    from moe_infer.offload.compute import CpuRows, cpu_experts

    fp8_dir, _ = fp8_checkpoint
    llm = LLM(model=fp8_dir, **KW, offload="cpu", slots_per_layer=1)
    m = llm.engine.runner.offload
    store = m.stores[1]
    layer = llm.engine.runner.model.moe_layers()[1].layer_idx
    sd = load_file(f"{fp8_dir}/model.safetensors")

    def by_hand(e: int, proj: str) -> torch.Tensor:
        q = sd[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"].float()
        s = sd[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight_scale_inv"]
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            for j in range(q.shape[1]):
                out[i, j] = q[i, j] * s[i // 16, j // 16]
        return out

    g = torch.Generator().manual_seed(0)
    x_rD = torch.randn(3, m.shape.hidden_size, generator=g)
    for e in (0, 5):
        w1, w3, w2 = by_hand(e, "gate_proj"), by_hand(e, "up_proj"), by_hand(e, "down_proj")
        want = (torch.nn.functional.silu(x_rD @ w1.t()) * (x_rD @ w3.t())) @ w2.t() * 0.5
        rows = CpuRows(torch.tensor([0, 1, 2]), x_rD, [e, e, e], torch.full((3,), 0.5))
        got = cpu_experts(rows, torch.zeros_like(x_rD), lambda k: m.host_weights(store, k, torch.float32))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    llm.shutdown()


@pytest.mark.timeout(600)
def test_offload_benchmark_fp8_smoke(tmp_path):
    """benchmarks/offload.py --quantization fp8 on CPU (tiny shapes, 32 x 32 blocks): the engines hold fp8 experts
    and the bound is built on the fp8 bytes (data + scales, counted here by hand); int4 runs the same way."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="2")
    script = os.path.join(root, "benchmarks", "offload.py")
    proc = subprocess.run([sys.executable, script, "--smoke", "--quantization", "int4", "--parts", "qwen3",
                           "--prefetch-rules", "saving", "--out", str(tmp_path), "--torch-threads", "1"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "offload_smoke_cpu_int4.json").read_text())
    D, F = 64, 32  # the qwen3 smoke shape: int32 codes, a bf16 scale per 32 values (groups of 32)
    int4_bytes = 3 * D * F // 2 + 2 * (2 * F * D // 32 + D * F // 32)
    assert not result["errors"] and {(r["quantization"], r["expert_bytes"]) for r in result["runs"]} == \
        {("int4", int4_bytes)}
    proc = subprocess.run([sys.executable, script, "--smoke", "--quantization", "fp8", "--parts", "mixtral,qwen3",
                           "--prefetch-rules", "saving", "--out", str(tmp_path), "--torch-threads", "1"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "offload_smoke_cpu_fp8.json").read_text())
    assert result["quantization"] == "fp8" and not result["errors"]
    link_bps = result["limits"]["h2d_gbps"] * 1e9
    assert sorted((r["shape"], r["streams"]) for r in result["runs"] if r["routing"] == "router") == \
        [("mixtral", 1), ("mixtral", 16), ("qwen3", 1), ("qwen3", 16)]
    for r in result["runs"]:
        D, F = {"mixtral": (64, 96), "qwen3": (64, 32)}[r["shape"]]
        fp8_bytes = 3 * D * F + 4 * (2 * F // 32 * D // 32 + D // 32 * F // 32)
        assert r["quantization"] == "fp8" and r["expert_bytes"] == fp8_bytes
        moved = (r["copied"] + r["streamed"] + r["cpu"] + r["shared"] + r["partial_missing"]) * fp8_bytes
        bound_s = moved / (link_bps + fp8_bytes / (r["cpu_ms_after_run"] / 1e3))
        assert r["needed"] > 0 and moved > 0
        assert r["bound_step_ms_after_run"] == pytest.approx(1e3 * bound_s / max(r["decode_steps"], 1), rel=1e-9)
        assert r["step_over_bound"] is None  # the limits' CPU rate is a bf16 expert's: no bound from it


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("offload", [
    dict(offload="cpu", slots_per_layer=2, miss_policy="wait"),
    dict(offload="cpu", slots_per_layer=2, miss_policy="wait", prefetch=False),
    dict(offload="nvme", nvme_reader="threads", slots_per_layer=2, miss_policy="wait"),
], ids=["cpu", "cpu_no_prefetch", "nvme"])
def test_fp8_offloaded_on_cuda_equals_resident(offload, fp8_checkpoint, tmp_path, monkeypatch):
    """CUDA: the pinned fp8 tier, data and scales copied on the side stream, the W8A8 grouped kernel on the slot
    pool ([S, ...] weights and scales, slot ids): the resident fp8 engine's greedy tokens (misses wait for the
    link: a miss the host computes runs W8A16, not bit-equal to the device's W8A8). float32 activations: a step
    whose experts do not all fit the slots runs the kernel once a round and adds the rounds' outputs, which in bf16
    rounds apart from the resident engine's single combine (on the H200 one greedy token of 30 flipped that way)."""
    from moe_infer.kernels import fused_moe_fp8 as kernel

    fp8_dir, _ = fp8_checkpoint
    if offload["offload"] == "nvme":
        offload = dict(offload, nvme_path=str(tmp_path))
    kw = dict(KW, device="cuda")
    want = _generate(LLM(model=fp8_dir, **kw))
    calls, real = [], kernel.fused_moe_fp8
    monkeypatch.setattr(kernel, "fused_moe_fp8", lambda x, ids, w, w13, s13, *a: calls.append(w13.shape[0])
                        or real(x, ids, w, w13, s13, *a))
    llm = LLM(model=fp8_dir, **kw, **offload)
    assert _generate(llm) == want
    assert 2 in calls  # the kernel ran on the slot pool of 2 slots a layer
    total = llm.get_offload_stats()["total"]
    assert total["needed"] > total["hits"] > 0 and total["gb_h2d"] > 0, str(total)
    if offload["offload"] == "cpu":
        assert all(s.store._region.pinned for s in llm.engine.runner.model.moe_layers())
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_w4_offloaded_on_cuda_equals_resident(fmt, w4_models, monkeypatch):
    """CUDA: int4 / mxfp4 experts in the pinned tier, packed data and scales copied on the side stream, the W4A16
    kernel on the slot pool ([S, ...] packed weights and scales, slot ids): the resident engine's greedy tokens
    (float32 activations, misses wait for the link)."""
    from moe_infer.kernels import fused_moe_w4a16 as kernel

    kw, _ = w4_models[fmt]
    cuda = dict(KW, device="cuda")
    want = _generate(LLM(**kw, **cuda))
    name = "fused_moe_int4" if fmt == "int4" else "fused_moe_mxfp4"
    calls, real = [], getattr(kernel, name)

    def counted(x, ids, w, w13, *a, **k):
        calls.append(w13.shape[0])
        return real(x, ids, w, w13, *a, **k)
    monkeypatch.setattr(kernel, name, counted)
    llm = LLM(**kw, **cuda, offload="cpu", slots_per_layer=2, miss_policy="wait")
    assert _generate(llm) == want
    assert 2 in calls  # the kernel ran on the slot pool of 2 slots a layer
    total = llm.get_offload_stats()["total"]
    assert total["needed"] > total["hits"] > 0 and total["gb_h2d"] > 0, str(total)
    llm.shutdown()
