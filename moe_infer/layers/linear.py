"""Dense linear layers at decode sizes: y = x @ W^T (+ bias) through a registered kernel where one is
faster than cuBLAS, `F.linear` everywhere else.

LINEAR_KERNELS["triton"] (`moe_infer.layers.linear_triton`, a plugin) is the skinny GEMM of
`moe_infer.kernels.skinny_gemm`: for 16-bit CUDA tensors of one row (a decode step of one sequence), or
up to four for a narrow output (a router), where it measured faster than cuBLAS (H100,
`benchmarks/trials/skinny_gemm_sweep.py`: 1.0-1.35x for the attention projections at one row, 1.4-2.8x
for the routers, whose cuBLAS GEMM is launch-bound). The attention projections, the MoE router and the dense
MLPs call `linear`; the LM head keeps cuBLAS (already at its bytes). float32 and CPU tensors, and
prefill, run `F.linear` as before.

Only in forwards that are captured as CUDA graphs (a decode graph, a layer graph), their eager warm-up
runs and the start-up warm-up: the engine runs those under `graph_kernels()`. An eager call of the
kernel cost 54-64 us of host time on a lent H100's host against 21-26 us for cuBLAS
(`benchmarks/trials/skinny_gemm_host.py`), and eager decode-sized calls (an offloading store's router and pre-gate, a capacity policy's step)
are bound by host time, not by the few microseconds of GPU time the kernel saves.

Legend: M rows (tokens), K in features, N out features.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F

from moe_infer.quant import linear_quantized
from moe_infer.registry import Registry


class SmallLinearKernel(NamedTuple):
    takes: Callable  # (M, N) -> bool: the kernel is faster than cuBLAS there
    fn: Callable  # (x_MK, w_NK, bias_N or None) -> y_MN


LINEAR_KERNELS: Registry[SmallLinearKernel] = Registry("linear kernel")
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_IN_GRAPH: ContextVar[bool] = ContextVar("linear_in_graph", default=False)


@contextmanager
def graph_kernels() -> Iterator[None]:
    """The forwards inside are captured as CUDA graphs (or compile for them): `linear` may take its kernel."""
    token = _IN_GRAPH.set(True)
    try:
        yield
    finally:
        _IN_GRAPH.reset(token)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through LINEAR_KERNELS["triton"] for a 2-D CUDA x of 16-bit rows where the
    kernel says it is faster (one row; a few for a narrow output), inside `graph_kernels()`. A quantized weight
    (one that carries its format, moe_infer/quant.py) goes through `linear_quantized`."""
    if getattr(weight, "quant", None) is not None:
        return linear_quantized(x, weight, bias)
    if x.dim() == 2 and x.is_cuda and "triton" in LINEAR_KERNELS:
        kernel = LINEAR_KERNELS.get("triton")
        if (kernel.takes(x.shape[0], weight.shape[0]) and x.dtype in _KERNEL_DTYPES and weight.dtype == x.dtype
                and x.stride(-1) == 1 and weight.stride(-1) == 1 and (bias is None or bias.is_contiguous())
                and _IN_GRAPH.get()):
            return kernel.fn(x, weight, bias)
    return F.linear(x, weight, bias)
