"""The shipped tiny MoE checkpoint (moe_infer/assets/tiny_moe): loads with transformers, stays small,
and generates Python-looking text. Model card: docs/tiny_moe.md."""
import ast
import json
import os
from pathlib import Path

import pytest
import torch

from moe_infer import assets

transformers = pytest.importorskip("transformers")

MAX_BYTES = 30_000_000


@pytest.fixture(scope="module")
def model_dir() -> str:
    return assets.default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_default_model_path_missing_folder_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "TINY_MOE_DIR", tmp_path / "tiny_moe")
    with pytest.raises(FileNotFoundError, match="tiny MoE checkpoint .* lacks config.json"):
        assets.default_model_path()


def test_checkpoint_is_small_and_complete(model_dir):
    files = {p.name: p.stat().st_size for p in Path(model_dir).iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert sum(files.values()) <= MAX_BYTES, files


def test_config_is_a_qwen3_moe(model_dir):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    assert config.model_type == "qwen3_moe" and raw["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config.num_experts == 16 and config.num_experts_per_tok == 2
    assert config.head_dim * config.num_attention_heads == config.hidden_size == 256
    assert config.num_hidden_layers == 6 and config.mlp_only_layers == []
    assert config.output_router_logits is False


def test_weights_are_bf16_and_cover_the_model(model_dir, model):
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
    assert "model.layers.5.mlp.experts.15.down_proj.weight" in keys
    assert "model.layers.0.mlp.gate.weight" in keys
    # every parameter came from the file (tied lm_head shares the embedding)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_round_trip_and_specials(tokenizer):
    text = 'def f(x):\n    """Doc with ü and \\t."""\n    return {"a": x ** 2}\n'
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2  # BPE merges: well under one token per two bytes on code
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) == 6144


def test_greedy_generation_looks_like_python(tokenizer, model):
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0])
    assert text.startswith("def fibonacci(n):\n    "), text  # a newline and an indented body
    words = set(text.replace("(", " ").replace(":", " ").split())
    python_words = {"return", "if", "for", "in", "def", "=", "not", "is", "None", "else", "self", '"""', "raise"}
    assert len(words & python_words) >= 2, text
    # the header and the first body line together are valid Python
    header, first_body = text.splitlines()[:2]
    ast.parse(f"{header}\n{first_body}\n")


def test_engine_greedy_equals_transformers_on_cpu(tokenizer, model):
    """Our engine (fp32, CPU, the default model) and transformers generate the same 32 greedy tokens."""
    from moe_infer import LLM, SamplingParams

    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):"]
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected.append(out[0, ids.shape[1]:].tolist())
    llm = LLM(model=None, dtype="float32", device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, out, ref in zip(prompts, outs, expected):
        comp = out.outputs[0]
        assert comp.finish_reason == "length", (prompt, comp.finish_reason)
        assert comp.token_ids == ref, f"{prompt!r}: engine {comp.token_ids} != transformers {ref}"
