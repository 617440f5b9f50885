"""Budget planning: how many expert slots each tier gets, decided once before the model is built.

    plan = plan_offload(cfg.offload, shape, device)   # raises naming the field when it cannot work

The GPU budget (GiB, or slots per layer) pays for the two stream buffers first (each holds
`stream_chunk` experts: large steps run through them) and then for cache slots, spread evenly
over the MoE layers (the first layers get the remainder). A budget smaller than one layer's
working set (top_k experts, what one token needs) is refused. The NVMe tier's pinned host cache
must hold two layers' experts (a large step may need every expert of a layer at once, while the
next layer's prefetch is read).

Legend: L MoE layers, E local experts per layer, D hidden, F expert intermediate, K top-k.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional

import torch

from moe_infer.offload.layout import ExpertLayout
from moe_infer.quant import QuantSpec

GiB = float(1 << 30)
ALIGN = 4096  # O_DIRECT: file offsets, lengths and buffer addresses in multiples of this


@dataclass(frozen=True)
class ExpertShape:
    """One routed expert's weights and the layout of the MoE layers."""

    num_layers: int  # L: MoE layers of the model
    num_local_experts: int  # E: experts of one layer on this rank
    top_k: int  # K
    hidden_size: int  # D
    intermediate_size: int  # F
    dtype: torch.dtype  # the model's (the compute dtype; the unquantized experts' storage)
    quant: Optional[QuantSpec] = None  # the experts' stored format (moe_infer/quant.py), None: dtype
    bias: bool = False  # the experts have gate/up and down biases (GPT-OSS), moved with their weights

    @cached_property
    def layout(self) -> ExpertLayout:
        """The tensors of one expert in its stored format (offload/layout.py)."""
        return ExpertLayout(self.hidden_size, self.intermediate_size, self.dtype, self.quant, self.bias)

    @property
    def w13_numel(self) -> int:
        return 2 * self.intermediate_size * self.hidden_size

    @property
    def w2_numel(self) -> int:
        return self.hidden_size * self.intermediate_size

    @property
    def nbytes(self) -> int:
        """One expert's bytes in its stored format (quantized: data and scales): what a slot holds, a copy moves."""
        return self.layout.nbytes

    @property
    def record_bytes(self) -> int:
        """One expert in an NVMe file or a host cache slot: its layout's tensors back to back, padded to ALIGN."""
        return -(-self.layout.stride // ALIGN) * ALIGN


@dataclass(frozen=True)
class OffloadPlan:
    store: str  # cpu | nvme
    shape: ExpertShape
    slots_per_layer: List[int]  # device cache slots of each MoE layer (in model order)
    stream_chunk: int  # experts per stream buffer (two buffers)
    host_slots: int  # nvme: pinned host cache slots (all layers); cpu: 0 (every expert is in host memory)
    nvme_dir: Optional[str]

    @property
    def device_bytes(self) -> int:
        return (sum(self.slots_per_layer) + 2 * self.stream_chunk) * self.shape.nbytes

    def describe(self) -> str:
        s = self.shape
        slots = sorted(set(self.slots_per_layer))
        fmt = "" if s.quant is None else f" ({s.quant.method})"
        text = (f"offload={self.store}: {s.num_layers} MoE layers x {s.num_local_experts} experts of "
                f"{s.nbytes / 2**20:.1f} MiB{fmt}; GPU: {'/'.join(map(str, slots))} cache slots per layer + 2 x "
                f"{self.stream_chunk} stream slots = {self.device_bytes / GiB:.2f} GiB")
        if self.store == "nvme":
            text += f"; host cache {self.host_slots} experts ({self.host_slots * s.record_bytes / GiB:.2f} GiB) over {self.nvme_dir}"
        else:
            text += f"; host: {s.num_layers * s.num_local_experts * s.nbytes / GiB:.2f} GiB"
        return text


def plan_offload(cfg, shape: ExpertShape) -> OffloadPlan:
    """The tiers' slot counts for `cfg` (an OffloadConfig) and the model's expert shape."""
    from moe_infer.offload.policies import CACHE_POLICIES
    from moe_infer.offload.prefetch import PREFETCH_RULES

    if cfg.cache_policy not in CACHE_POLICIES:
        raise ValueError(f"offload.cache_policy={cfg.cache_policy!r} is not one of {CACHE_POLICIES.names()}")
    if cfg.prefetch_rule not in PREFETCH_RULES:
        raise ValueError(f"offload.prefetch_rule={cfg.prefetch_rule!r} is not one of {PREFETCH_RULES.names()}")
    L, E, K = shape.num_layers, shape.num_local_experts, shape.top_k
    chunk = min(cfg.stream_chunk or max(1, K // 2), E)
    working_set = min(K, E)
    if cfg.slots_per_layer is not None:
        per_layer = [min(cfg.slots_per_layer, E)] * L
    else:
        budget = cfg.gpu_expert_budget_gb if cfg.gpu_expert_budget_gb is not None else 0.25 * L * E * shape.nbytes / GiB
        total = int(budget * GiB // shape.nbytes)
        if total < max(working_set, 2 * chunk):
            raise ValueError(
                f"offload.gpu_expert_budget_gb={budget:g} holds {total} experts of {shape.nbytes / 2**20:.1f} MiB; "
                f"at least {max(working_set, 2 * chunk)} are needed (one layer's working set of top_k={K} "
                f"experts and 2 stream buffers of {chunk}): "
                f"{max(working_set, 2 * chunk) * shape.nbytes / GiB:.3f} GiB")
        cache = min(total - 2 * chunk, L * E)
        per_layer = [min(E, cache // L + (1 if i < cache % L else 0)) for i in range(L)]
    host_slots, nvme_dir = 0, None
    if cfg.store == "nvme":
        nvme_dir = check_nvme_dir(cfg.nvme_path, L * E * shape.record_bytes)
        host_budget = cfg.cpu_budget_gb if cfg.cpu_budget_gb is not None else 4 * E * shape.record_bytes / GiB
        host_slots = min(int(host_budget * GiB // shape.record_bytes), L * E)
        need = min(2 * E, L * E)  # one layer's experts and the next layer's prefetch
        if host_slots < need:
            raise ValueError(
                f"offload.cpu_budget_gb={host_budget:g} holds {host_slots} experts; the host cache must hold at "
                f"least two layers' {need} experts ({need * shape.record_bytes / GiB:.3f} GiB)")
    return OffloadPlan(cfg.store, shape, per_layer, chunk, host_slots, nvme_dir)


def check_nvme_dir(path: Optional[str], need_bytes: int) -> str:
    """The NVMe directory, checked: exists, writable, room for every expert (else a ValueError)."""
    if not path:
        raise ValueError("offload.store=nvme needs offload.nvme_path")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ValueError(f"offload.nvme_path={path!r} is not a directory")
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise ValueError(f"offload.nvme_path={path!r} is not readable and writable by this process")
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise ValueError(f"offload.nvme_path={path!r} has {free / GiB:.2f} GiB free; the experts need "
                         f"{need_bytes / GiB:.2f} GiB")
    return path
