"""Programmatic dependent launch (PDL, sm_90+), shared by the kernel chains of the fused MoE path and
the routing kernels.

A kernel launched with PDL may be placed on the SMs while the kernel before it in the stream still
drains; it calls `pdl_enter` before its first load, which waits until the previous kernel has
finished and its writes are visible (griddepcontrol.wait), then lets the next kernel be launched
early in turn. Every program of such a kernel calls it, so "finished" is transitive down the chain.

    pdl_enter(USE_PDL)            in the kernel, before any load
    use_pdl(t, env)               launch keyword arguments: USE_PDL=True, launch_pdl=True on an sm_90+
                                  CUDA device unless the environment variable `env` is "0"
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover  (older Triton: wrappers then launch without PDL)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Kernels launched with PDL: wait until the previous kernel's writes are visible (before any load
    of its outputs), then allow the next kernel to be launched; no-op otherwise."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and gdc_wait is not None


def use_pdl(t: torch.Tensor, env: str = "MOE_FUSED_PDL") -> dict:
    """Kernel keyword arguments for a launch over tensors on t's device: PDL on sm_90+ CUDA devices
    (the kernel must call `pdl_enter` first), unless the environment variable `env` is "0"."""
    on = (t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get(env, "1") == "1"
          and _device_has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device()))
    return dict(USE_PDL=True, launch_pdl=True) if on else dict(USE_PDL=False)
