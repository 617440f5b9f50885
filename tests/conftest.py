"""Shared pytest setup: `gpu` tests skip without CUDA; the Triton interpreter is on for CPU runs."""
import os

import pytest

# Triton kernels run on CPU tensors only under the interpreter; it must be set before triton loads.
try:
    import torch as _torch

    _HAS_CUDA = _torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the lent H100/H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def one_thread():
    """Small tensors on a busy 2-core machine: OpenMP's second thread only adds stalls (a test module takes it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = _torch.get_num_threads()
    _torch.set_num_threads(1)
    yield
    _torch.set_num_threads(before)
