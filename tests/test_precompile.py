"""moe_infer/kernels/precompile.py on the CPU: worker processes compile Triton kernel variants, given as Triton's own
specialization data, for a CUDA target (no GPU needed: ptxas runs for the target's arch) into the disk cache, where
the lookup of Triton's own compile then finds them; failures are reported, never raised. The dry pass that finds
the variants needs a GPU: tests/test_jit_warmup.py (no compile after start-up) covers it there."""
import inspect
import os

import pytest

from moe_infer.config import ModelConfig

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.jit import JITFunction  # noqa: E402

from moe_infer.kernels.precompile import CompilePool, KernelSpec, default_workers, is_cached  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ATTRS = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}  # 16-byte aligned pointers, as launched


def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


# a JITFunction even under TRITON_INTERPRET=1 (set by conftest without a GPU), where @triton.jit gives the interpreter's
scale_kernel = JITFunction(scale_kernel)


def _spec(block: int, target) -> KernelSpec:
    """The variant a launch with BLOCK=block would compile, serialized as Triton's launch hook gets it."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    options = make_backend(target).parse_options({"num_warps": 4})
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    args = ["scale_kernel", signature, {(3,): block}, ATTRS, options, str(block)]
    if "target" in inspect.signature(serialize_specialization_data).parameters:
        args.append(target)
    return KernelSpec(scale_kernel.fn.__module__, scale_kernel.fn.__qualname__, serialize_specialization_data(*args))


@pytest.fixture
def target(tmp_path, monkeypatch):
    from triton.backends.compiler import GPUTarget

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    return GPUTarget("cuda", 90, 32)


@pytest.mark.timeout(300)
def test_workers_fill_the_cache_triton_reads(target):
    from triton import knobs
    from triton.compiler import compile as triton_compile
    from triton.compiler.compiler import ASTSource, make_backend

    specs = [_spec(64, target), _spec(128, target)]
    assert not any(is_cached(scale_kernel, s.data, target) for s in specs)
    pool = CompilePool(2, target)
    for s in specs:
        pool.submit(s)
    compiled, errors = pool.finish()
    assert (compiled, errors, pool.num_submitted) == (2, [], 2)
    assert all(is_cached(scale_kernel, s.data, target) for s in specs)
    # Triton's own compile of the variant, as a launch asks for it, is a cache hit
    hits = []
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    try:
        src = ASTSource(scale_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                        {(3,): 64}, ATTRS)
        triton_compile(src, target=target, options=make_backend(target).parse_options({"num_warps": 4}).__dict__)
    finally:
        knobs.compilation.listener = None
    assert hits == [True]


@pytest.mark.timeout(120)
def test_failures_are_reported_not_raised(target):
    pool = CompilePool(1, target)
    pool.submit(KernelSpec("no_such_module_here", "kernel", _spec(64, target).data))
    compiled, errors = pool.finish()
    assert compiled == 0 and len(errors) == 1 and "no_such_module_here" in errors[0]

    pool = CompilePool(2, target, python="/nonexistent/python")
    pool.submit(_spec(64, target))  # no worker starts: nothing raised, the spec is left to its launch
    compiled, errors = pool.finish()
    assert compiled == 0 and len(errors) == 1 and "did not start" in errors[0]


def test_worker_count():
    assert 1 <= default_workers() <= 32
    with pytest.raises(ValueError, match="compile_workers"):
        ModelConfig(compile_workers=-1)
    with pytest.raises(ValueError, match="at least one worker"):
        CompilePool(0, None)


# Qwen3-30B-A3B's layer shape, 2 layers, a small vocabulary and context
SMALL = dict(vocab_size=4096, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
             norm_topk_prob=True, max_position_embeddings=1024,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6}, eos_token_id=0, bos_token_id=1,
             pad_token_id=0, tie_word_embeddings=False)


@pytest.mark.gpu
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_parallel_warmup_on_the_gpu(tmp_path, monkeypatch, caplog):
    """A cold Triton cache: the start-up's warm-up sends its variants to 4 worker processes and compiles none in the
    engine's process; the engine then generates the same greedy tokens as a second one started without workers (the
    dry pass left nothing behind that a step reads)."""
    import logging

    from transformers import Qwen3MoeConfig

    from moe_infer import LLM, SamplingParams

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    Qwen3MoeConfig(**SMALL).save_pretrained(tmp_path / "model")
    kw = dict(model=str(tmp_path / "model"), load_format="dummy", device="cuda", dtype="bfloat16", max_num_seqs=8,
              max_num_batched_tokens=512, cuda_graph_max_batch=8, cuda_graph_max_tokens=512, num_kv_blocks=8 * 64 + 8)
    in_process = []
    triton.knobs.compilation.listener = lambda **k: None if k["cache_hit"] else in_process.append(k["src"].name)
    try:
        with caplog.at_level(logging.INFO, logger="moe_infer.engine.warmup"):
            llm = LLM(compile_workers=4, **kw)
    finally:
        triton.knobs.compilation.listener = None
    assert "compiled by 4 worker processes" in caplog.text, caplog.text[-3000:]
    assert "dry pass of the Triton warm-up failed" not in caplog.text and not in_process, in_process[:20]
    assert "launchers left" not in caplog.text  # the workers built them too
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 70, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "serial"))
    want = [o.outputs[0].token_ids for o in LLM(compile_workers=0, **kw).generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_when_the_warmup_uses_workers():
    """Workers where a step can be a CUDA graph (model.enforce_eager aside: the dry pass captures its own), none
    under a mesh, with a capacity policy (its graphs are blocked) or compile_workers=0."""
    from dataclasses import replace
    from types import SimpleNamespace

    import torch

    from moe_infer.config import EngineConfig
    from moe_infer.engine.backends import load_plugins
    from moe_infer.engine.warmup import compile_workers
    from moe_infer.layers.moe import MoEBackends

    load_plugins()  # the Triton experts backend registered

    def runner(distributed=False, policy="dropless", **model):
        cfg = EngineConfig()
        cfg = replace(cfg, model=replace(cfg.model, **model))
        return SimpleNamespace(cfg=cfg, device=torch.device("cuda"),
                               parallel=SimpleNamespace(is_distributed=distributed),
                               backends=MoEBackends(experts="triton", policy=policy),
                               model=SimpleNamespace(moe_layers=lambda: []))

    assert compile_workers(runner()) == 0  # off unless asked for: one engine's default must not swamp a machine
    assert compile_workers(runner(compile_workers=None)) == default_workers()
    assert compile_workers(runner(enforce_eager=True, compile_workers=None)) == default_workers()
    assert compile_workers(runner(compile_workers=3)) == 3
    assert compile_workers(runner(compile_workers=0)) == 0
    assert compile_workers(runner(distributed=True, compile_workers=3)) == 0
    assert compile_workers(runner(policy="capacity", compile_workers=3)) == 0


class _FakeDriver:
    """Enough of a CUDA driver for Triton to bind a launch on the CPU (device 0, stream 0, sm_90)."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@pytest.mark.timeout(300)
def test_dry_launches_find_compile_and_load_variants(target):
    """Under dry_launches a launch runs nothing: its variant goes to on_missing once (Triton's own specialization data,
    from the real binding), a worker-style compile of it puts it on disk, and the next dry launch loads it instead.
    In a fresh process without TRITON_INTERPRET: a process that has run Triton's interpreter (other tests of an
    xdist worker) has its `triton.language` patched, and a real compile there fails."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import test_precompile as t; t.check_dry_launches({tuple(target.__dict__.values())!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def check_dry_launches(target_fields) -> None:
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction as JF

    from moe_infer.kernels.precompile import compile_spec, dry_launches

    target = GPUTarget(*target_fields)
    kernel = JITFunction(scale_kernel.fn)  # a fresh one: no variant in memory
    run = JF.run
    x, y = torch.zeros(256), torch.zeros(256)
    missing = []
    active = driver._active  # None on a machine without a GPU (its default driver cannot be made)
    driver.set_active(_FakeDriver(target))
    try:
        with dry_launches(missing.append):
            for _ in range(3):
                assert kernel[(4,)](x, y, 200, BLOCK=64) is None  # nothing launched, nothing compiled
        assert len(missing) == 1 and missing[0].qualname == "scale_kernel"
        assert JF.run is run and triton.knobs.runtime.jit_cache_hook is None  # restored
        assert not is_cached(kernel, missing[0].data, target)
        compile_spec(kernel, missing[0].data, target)  # what a worker does
        assert is_cached(kernel, missing[0].data, target)
        again = []
        with dry_launches(again.append):
            kernel[(4,)](x, y, 200, BLOCK=64)
        assert again == [] and len(kernel.device_caches[0][0]) == 1  # loaded from disk into memory
    finally:
        driver.set_active(active)
