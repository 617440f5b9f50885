"""Experts: token dispatch/combine and the grouped expert compute backends."""
from moe_infer.experts.local_dispatch import DispatchMetadata, LocalDispatcher
from moe_infer.experts.reference import EXPERT_BACKENDS, experts_torch

__all__ = ["DispatchMetadata", "EXPERT_BACKENDS", "LocalDispatcher", "experts_torch"]
