"""Resolving a backend name ("auto" included) against a registry, by the device of the tensors.

"auto" means the Triton kernels on CUDA and the PyTorch references elsewhere; the table below is
the only place that choice is made for the routing-internal registries (permutation, capacity
kernels); the engine resolves its config strings the same way (`moe_infer.engine.backends`). A
Triton backend registers on import of `moe_infer.routing.triton_select` (see `moe_infer.plugins`);
until it is loaded, "auto" falls back to the reference.
"""
from __future__ import annotations

import torch

from moe_infer.registry import Registry

AUTO_BACKEND_BY_DEVICE = {"cuda": "triton", "cpu": "torch"}
REFERENCE_BACKEND = "torch"


def resolve_backend(registry: Registry, name: str, device: torch.device | str) -> str:
    """A registered backend name for `name` on `device` (raises KeyError naming the choices)."""
    if name != "auto":
        registry.get(name)  # validates, with the list of available names
        return name
    preferred = AUTO_BACKEND_BY_DEVICE.get(torch.device(device).type, REFERENCE_BACKEND)
    return preferred if preferred in registry else REFERENCE_BACKEND

