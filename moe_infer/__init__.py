"""moe_infer: an expert-parallel inference engine for Mixture-of-Experts LLMs.

`from moe_infer import LLM, SamplingParams` imports the engine (and torch) on first use, not
`import moe_infer`: the launcher composes its configuration and sets what must be set before torch
loads (moe_infer/host_threads.py) first.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_infer.engine.llm import LLM
    from moe_infer.engine.outputs import CompletionOutput, RequestOutput
    from moe_infer.engine.sampling_params import SamplingParams

_EXPORTS = {"LLM": "moe_infer.engine.llm", "SamplingParams": "moe_infer.engine.sampling_params",
            "RequestOutput": "moe_infer.engine.outputs", "CompletionOutput": "moe_infer.engine.outputs"}
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'moe_infer' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
