"""Where an engine's start-up goes, in named parts (benchmarks/startup.py prints them, the start-up log sums them).

Each part is the wall time of one stretch of `LLMEngine.__init__` (moe_infer/engine/llm_engine.py, model_runner.py),
the stretches one after the other, so that the parts add up to nearly the whole `LLM(...)`:

    parallel_init_s   the mesh (one rank: the device chosen) and the checkpoint's fingerprint
    cuda_init_s       the CUDA context, made at once (else the first tensor on the GPU makes it, inside another part)
    plugins_s         the backends resolved: the Triton kernel modules imported (and Triton with them)
    transformers_import_s  transformers and its config classes imported (the first time in a process: seconds, most
                      of them transformers' own lazy-module set-up, which reads every model file's `__all__`)
    hf_config_s       config.json read through transformers into the ModelArch (the EP dispatcher and the offload
                      budget, which need it, made here too)
    model_load_s      the model built and its weights read (or made at random: load_format=dummy)
    kv_cache_s        the KV cache sized (free memory, the activations' bound) and allocated
    kernel_warmup_s   every Triton kernel variant a step can select compiled (in parallel where it can:
                      moe_infer/kernels/precompile.py) and run once (moe_infer/engine/warmup.py)
    cuda_graphs_s     the decode graphs' buffers and their warm-up forwards, the prefill graphs' buffers
    tokenizer_s       the checkpoint's tokenizer
    scheduler_s       block manager, scheduler, step executor (and the speculator, when on)
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator


class StartupTimings(Dict[str, float]):
    """name -> seconds; `part(name)` times a stretch (a name timed twice adds up)."""

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - start

    def summary(self) -> str:
        """'model_load 1.23 s, kv_cache 0.05 s, ...' in the order timed."""
        return ", ".join(f"{name[:-2] if name.endswith('_s') else name} {sec:.2f} s" for name, sec in self.items())
