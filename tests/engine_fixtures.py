"""Shared by the engine tests: tiny checkpoints (cached per process), a character tokenizer, the HF oracle.

The character tokenizer maps <pad>, <s>, </s> to 0, 1, 2 (the tiny configs' pad/bos/eos ids) and
each printable ASCII character to one id, so stop strings and detokenisation are exact to test.
"""
from __future__ import annotations

import os
import string
import tempfile
from typing import Dict, List, Tuple

import torch

from tiny_hf import load_hf_model, make_tiny_checkpoint

_ROOT = tempfile.mkdtemp(prefix="moe_infer_engine_tests_")
_CKPTS: Dict[Tuple, str] = {}
_HF: Dict[Tuple[str, str], torch.nn.Module] = {}


def checkpoint(family: str, tokenizer: bool = False, **overrides) -> str:
    """A tiny float32 checkpoint of family (built once per process for the same arguments)."""
    key = (family, tokenizer, tuple(sorted(overrides.items())))
    if key not in _CKPTS:
        path = os.path.join(_ROOT, f"{family}_{len(_CKPTS)}")
        make_tiny_checkpoint(family, path, seed=1234, **overrides)
        if tokenizer:
            save_char_tokenizer(path)
        _CKPTS[key] = path
    return _CKPTS[key]


def save_char_tokenizer(path: str) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)


def hf_model(path: str, device: str = "cpu") -> torch.nn.Module:
    if (path, device) not in _HF:
        model = load_hf_model(path).to(device)
        model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as ignore_eos does
        _HF[path, device] = model
    return _HF[path, device]


@torch.inference_mode()
def hf_greedy(path: str, prompt: List[int], max_new_tokens: int, device: str = "cpu") -> Tuple[List[int], torch.Tensor]:
    """transformers' greedy `generate` of one prompt: (new tokens, float32 logprobs [steps, V])."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)
    out = hf_model(path, device).generate(torch.tensor([prompt], device=device), generation_config=gc)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack(out.scores)[:, 0].float().log_softmax(-1).cpu()
