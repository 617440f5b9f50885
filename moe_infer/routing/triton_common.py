"""Checks shared by the Triton routing wrappers (no triton import: usable without it)."""
from __future__ import annotations

import os

import torch


def can_run_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors when the interpreter is on (TRITON_INTERPRET=1)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def check_triton_device(name: str, t: torch.Tensor) -> None:
    if not can_run_triton(t):
        raise RuntimeError(
            f"{name} is on {t.device}: the Triton routing kernels need a CUDA tensor "
            "(or TRITON_INTERPRET=1 set before triton is imported, for CPU tests)"
        )


def check_int_ids(name: str, ids: torch.Tensor) -> None:
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64 expert ids, got {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must be [T, K], got shape {tuple(ids.shape)}")
