"""The NVMe tier: every expert in files on a local disk, read into pinned host slots.

Layout: one file per MoE layer under a fresh directory in `offload.nvme_path`, expert e at offset
e * record_bytes, its record [w13 (2F x D) | w2 (D x F)] (each with its scales when quantized) padded to
4096 bytes, so one expert is one aligned read. The loader writes the files through a shared memory map
(the checkpoint's tensors land in the file as they are read, never all in RAM); `finish_load` syncs them
to disk and drops them from the page cache, so reads come from the disk, not from RAM.

Readers (`offload.nvme_reader`):
  deepspeed  DeepSpeed's async I/O op (libaio, O_DIRECT, a queue of block reads on its own threads)
  threads    the fallback: os.preadv with O_DIRECT on a thread pool, each expert split into 8 MiB
             blocks read in parallel (the GIL is released during each read)
`auto` takes DeepSpeed when its op builds (it needs libaio: `apt-get install libaio-dev`), and
says at start-up why it could not.

Legend: E experts of a layer, D hidden, F expert intermediate.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Dict, List, Tuple

import torch

from moe_infer.offload.plan import ExpertShape

logger = logging.getLogger(__name__)
_BLOCK = 8 << 20
_DIRECT = getattr(os, "O_DIRECT", 0)


class ThreadReader:
    name = "threads"

    def __init__(self, num_threads: int = 8) -> None:
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="moe-nvme")
        self.fds: dict = {}
        self.pending: list = []

    def _fd(self, path: str) -> int:
        if path not in self.fds:
            try:
                self.fds[path] = os.open(path, os.O_RDONLY | _DIRECT)
            except OSError:  # a file system without O_DIRECT (tmpfs): buffered reads
                self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def submit(self, buf: torch.Tensor, path: str, offset: int) -> None:
        fd, view = self._fd(path), memoryview(buf.numpy())
        for start in range(0, buf.numel(), _BLOCK):
            self.pending.append(self.pool.submit(_pread_all, fd, view[start:start + _BLOCK], offset + start))

    def wait_all(self) -> None:
        done, self.pending = self.pending, []
        wait(done)
        for f in done:
            f.result()  # re-raises a failed read

    def close(self) -> None:
        self.wait_all()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.pool.shutdown()


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"short read at offset {offset} of an offloaded expert file")
        view, offset = view[n:], offset + n


class DeepSpeedReader:
    name = "deepspeed"

    def __init__(self, num_threads: int = 8) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError("DeepSpeed's async_io op cannot be built here (it needs libaio: "
                               "apt-get install libaio-dev)")
        logger.info("offload: loading DeepSpeed's async_io op (compiled on its first use here, minutes; cached after)")
        self.handle = builder.load(verbose=False).aio_handle(1 << 20, 64, False, True, num_threads)
        self.num_pending = 0

    def submit(self, buf: torch.Tensor, path: str, offset: int) -> None:
        if self.handle.async_pread(buf, path, offset) != 0:
            raise OSError(f"DeepSpeed async_pread of {path} at {offset} was refused")
        self.num_pending += 1

    def wait_all(self) -> None:
        if self.num_pending:
            done = self.handle.wait()
            if done != self.num_pending:
                raise OSError(f"DeepSpeed async I/O completed {done} of {self.num_pending} expert reads")
            self.num_pending = 0

    def close(self) -> None:
        self.wait_all()


def make_reader(kind: str):
    """The NVMe reader for offload.nvme_reader; `auto` falls back to threads and says why."""
    if kind in ("auto", "deepspeed"):
        try:
            reader = DeepSpeedReader()
            logger.info("offload: NVMe reads through DeepSpeed async I/O")
            return reader
        except Exception as err:  # noqa: BLE001 - ImportError, a failed op build, a missing libaio
            if kind == "deepspeed":
                raise RuntimeError(f"offload.nvme_reader=deepspeed: {err}") from err
            logger.warning("offload: DeepSpeed async I/O is not available (%s: %s); NVMe reads use the "
                           "thread-pool reader (os.preadv, O_DIRECT, 8 threads)", type(err).__name__, err)
    return ThreadReader()


class NvmeFiles:
    """The expert files of one engine: created at start-up, deleted at close."""

    def __init__(self, root: str, shape: ExpertShape) -> None:
        self.shape = shape
        self.dir = tempfile.mkdtemp(prefix=f"moe_infer_experts_{os.getpid()}_", dir=root)
        self.paths: List[str] = []

    def layer_file(self, num_experts: int) -> Tuple[str, torch.Tensor]:
        """A new layer file and its shared memory map as uint8 [E, record_bytes] (written by the loader)."""
        path = os.path.join(self.dir, f"layer_{len(self.paths):03d}.experts")
        rec = self.shape.record_bytes
        try:
            with open(path, "wb") as f:  # the blocks are reserved now: a full disk fails here, not mid-load
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(f.fileno(), 0, num_experts * rec)
                else:
                    f.truncate(num_experts * rec)
            mapped = torch.from_file(path, shared=True, size=num_experts * rec, dtype=torch.uint8, device="cpu")
        except OSError as err:
            raise ValueError(f"offload.nvme_path: cannot create expert file {path}: {err}") from err
        self.paths.append(path)
        return path, mapped.view(num_experts, rec)

    def sync(self) -> None:
        """Everything the loader wrote goes to disk and out of the page cache."""
        for path in self.paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def record_views(rec_ER: torch.Tensor, shape: ExpertShape) -> Dict[str, torch.Tensor]:
    """name -> [E, *shape] views of each expert's tensors (offload/layout.py: w13 and w2, with their scales
    when quantized) into uint8 records [E, record_bytes] (a file map or host slots)."""
    return shape.layout.views(rec_ER)
