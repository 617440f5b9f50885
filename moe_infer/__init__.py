"""moe_infer: an expert-parallel inference engine for Mixture-of-Experts LLMs."""
from moe_infer.engine.llm import LLM
from moe_infer.engine.outputs import CompletionOutput, RequestOutput
from moe_infer.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
