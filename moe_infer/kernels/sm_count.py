"""The SM count of a CUDA device, asked of the driver once per device: the kernels that size their grids by it
(persistent GEMMs, split-KV attention, the skinny GEMM's tiles) call it on every launch. Each caller keeps its
own stand-in for the CPU interpreter."""
from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
