"""moe_infer: an expert-parallel inference engine for Mixture-of-Experts LLMs."""
