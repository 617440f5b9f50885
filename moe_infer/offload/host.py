"""Host memory for experts, planned once at start-up: page-locked on CUDA, 4096-byte aligned.

torch's pinned allocator rounds every block up to a power of two (a 45 GiB request would lock 64
GiB), so regions are plain host tensors registered with `cudaHostRegister` (SGLang's host pools do
the same), unregistered when the region is released. Alignment lets the NVMe reader use O_DIRECT
into the same memory.
"""
from __future__ import annotations

import logging
import time

import torch

from moe_infer.offload.plan import ALIGN

logger = logging.getLogger(__name__)


class HostRegion:
    """`nbytes` of host memory as a uint8 tensor (`.data`), page-locked when `pin` and CUDA is up."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes, self.pinned, self._registered = nbytes, False, False
        pin = pin and nbytes > 0 and torch.cuda.is_available()
        register = getattr(torch.cuda.cudart(), "cudaHostRegister", None) if pin else None
        if pin and register is None:  # a torch without the binding: the caching allocator (rounded up)
            logger.warning("torch.cuda.cudart() has no cudaHostRegister: pinning %.2f GiB through torch's "
                           "allocator, which rounds it up to a power of two", nbytes / 2**30)
        self._raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device="cpu",  # even under torch.device("cuda")
                                pin_memory=pin and register is None)
        start = (-self._raw.data_ptr()) % ALIGN
        self.data = self._raw[start:start + nbytes]
        if register is not None:
            t0 = time.perf_counter()
            err = register(self.data.data_ptr(), nbytes, 0)
            err = err[0] if isinstance(err, tuple) else err
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (error {int(err)}): "
                                   "host memory cannot be page-locked; lower the offloaded size or set "
                                   "offload.pin_memory=false (copies then run at pageable speed)")
            self._registered = True
            logger.debug("pinned %.2f GiB in %.2f s", nbytes / 2**30, time.perf_counter() - t0)
        self.pinned = pin

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        return self.data[offset:offset + nbytes].view(dtype).view(*shape)

    def release(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self._registered = self.pinned = False

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass


def layer_host_tensors(num_experts: int, layout, pin: bool):
    """(region, {name: [E, *shape]}): one layer's experts in one host region (the CPU tier), each expert's
    tensors in its stored format back to back (offload/layout.py)."""
    region = HostRegion(num_experts * layout.stride, pin)
    return region, layout.views(region.data.view(num_experts, layout.stride))
