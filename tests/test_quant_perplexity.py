"""Perplexity of the shipped tiny trained model (moe_infer/assets/tiny_moe) per weight format on its held-out text
(the standard library's validation files, moe_infer/experiments/heldout.py): quantized at load, fp8 within 1 % of
the unquantized model's perplexity and int4 within 5 %. On the CPU the formats run their reference paths (dense
layers and experts dequantized per call, float32 activations); benchmarks/quant_e2e.py measures the same on a GPU
(bf16, the W8A8 and W4A16 kernels) over longer text.
"""
import math

import pytest
import torch

BOUNDS = {"fp8": 1.01, "int4": 1.05}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.timeout(300)
def test_tiny_model_perplexity_per_format():
    from moe_infer.assets import default_model_path
    from moe_infer.config import RoutingConfig
    from moe_infer.engine.llm_engine import load_tokenizer
    from moe_infer.experiments import heldout
    from moe_infer.experiments.scoring import PrefillScorer, perplexity

    path = default_model_path()
    windows = heldout.token_windows(load_tokenizer(path), heldout.stdlib_validation(), 128, 8)
    ppl, stored = {}, {}
    for fmt in (None, "fp8", "int4"):
        scorer = PrefillScorer(path, RoutingConfig(), 8, 128, "cpu", torch.float32, quantization=fmt)
        experts = scorer.model.moe_layers()[0].store.w13_E2FD
        stored[fmt] = (experts.dtype, getattr(getattr(experts, "quant", None), "fmt", None))
        ppl[fmt], count = perplexity(scorer, windows)
        assert count == 8 * 127
    assert stored == {None: (torch.float32, None), "fp8": (torch.float8_e4m3fn, "fp8_block"),
                      "int4": (torch.int32, "int4")}
    # a trained model on text it never saw: far below a uniform guess over the vocabulary, far above 1
    vocab = scorer.model.arch.vocab_size
    assert 2.0 < ppl[None] < vocab / 10, ppl
    for fmt, bound in BOUNDS.items():
        assert ppl[fmt] / ppl[None] <= bound, f"{fmt}: perplexity {ppl[fmt]:.4f} vs {ppl[None]:.4f} unquantized"
    assert ppl["int4"] != ppl[None] and ppl["fp8"] != ppl[None] and all(math.isfinite(v) for v in ppl.values())
