"""Config strings -> the MoE layer's backends, looked up in the registries (no `if` chains); the
offload manager of an offloading expert store.

"auto" picks the first registered name of the device type's preference list: Triton on CUDA when
its plugin module registered it, PyTorch otherwise. Plugins are loaded first so that optional
backends have had their chance to register.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

import torch

from moe_infer.config import EngineConfig
from moe_infer.experts.reference import EXPERT_BACKENDS
from moe_infer.layers.moe import MoEBackends
from moe_infer.offload.store import EXPERT_STORES
from moe_infer.plugins import load_plugins
from moe_infer.registry import Registry
from moe_infer.routing.capacity import CAPACITY_POLICIES
from moe_infer.routing.select import ROUTING_BACKENDS

AUTO_PREFERENCE: Dict[str, Tuple[str, ...]] = {"cuda": ("triton", "torch"), "cpu": ("torch",)}


def resolve_name(registry: Registry, name: str, device: torch.device, field: str) -> str:
    """The registered backend a config string means on this device (KeyError naming the field)."""
    if name == "auto":
        for candidate in AUTO_PREFERENCE.get(device.type, ("torch",)):
            if candidate in registry:
                return candidate
        raise KeyError(f"{field}=auto: none of {AUTO_PREFERENCE.get(device.type)} is registered "
                       f"({registry.kind}: {', '.join(registry.names())})")
    if name not in registry:
        hint = " (the Triton backends need `pip install triton`)" if name == "triton" else ""
        raise KeyError(f"{field}={name!r} is not a registered {registry.kind}; available: "
                       f"{', '.join(registry.names())}{hint}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{field}=triton runs Triton kernels, which need a CUDA device; this engine runs on "
                         f"{device}: use {field}=auto or {field}=torch")
    return name


def resolve_moe_backends(cfg: EngineConfig, device: torch.device | str) -> MoEBackends:
    """MoEBackends for cfg on device; the load statistics are attached once the model is known."""
    device = torch.device(device)
    load_plugins()
    r = cfg.routing
    return MoEBackends(
        routing=resolve_name(ROUTING_BACKENDS, r.backend, device, "routing.backend"),
        policy=resolve_name(CAPACITY_POLICIES, r.policy, device, "routing.policy"),
        policy_kwargs=dict(capacity_factor=r.capacity_factor, min_capacity=r.min_capacity, drop_by=r.drop_by),
        experts=resolve_name(EXPERT_BACKENDS, cfg.experts.backend, device, "experts.backend"),
        store=resolve_name(EXPERT_STORES, cfg.offload.store, device, "offload.store"),
    )


def offload_manager(cfg: EngineConfig, model_path: str, device: torch.device, dtype: torch.dtype,
                    backends: MoEBackends):
    """The OffloadManager of an offloading store (None when resident): the budget planned from the
    checkpoint's config before the model is built (an impossible budget fails here, naming it)."""
    if backends.store == "resident":
        return None
    from moe_infer.models.hf_config import load_arch
    from moe_infer.models.online_quant import with_online_quant
    from moe_infer.offload import ExpertShape, OffloadManager, plan_offload

    arch = with_online_quant(load_arch(model_path)[0], cfg.model.quantization, device)  # the stored format
    d = backends.dispatcher
    shape = ExpertShape(num_layers=len(arch.moe_layer_ids),
                        num_local_experts=arch.num_experts if d is None else d.num_local_experts,
                        top_k=arch.top_k, hidden_size=arch.hidden_size,
                        intermediate_size=arch.moe_intermediate_size, dtype=dtype, quant=arch.quant,
                        bias=arch.expert_bias)
    return OffloadManager(cfg.offload, plan_offload(cfg.offload, shape), device)
