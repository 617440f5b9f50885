"""The NVMe tier: expert bytes written through the loader's file map come back exactly, through both
readers (DeepSpeed async I/O and the thread-pool fallback); a missing reader is said at start-up."""
from __future__ import annotations

import logging

import pytest
import torch

from moe_infer.offload import nvme
from moe_infer.offload.host import HostRegion
from moe_infer.offload.plan import ExpertShape


def _readers():
    out = [nvme.ThreadReader]
    try:
        nvme.DeepSpeedReader()
        out.append(nvme.DeepSpeedReader)
    except Exception:  # noqa: BLE001 - no libaio here: only the fallback is tested
        pass
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reader_cls", _readers(), ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_bytes_round_trip_exactly(tmp_path, reader_cls, dtype):
    shape = ExpertShape(num_layers=2, num_local_experts=5, top_k=2, hidden_size=96, intermediate_size=40, dtype=dtype)
    assert shape.record_bytes % 4096 == 0 and shape.record_bytes > shape.nbytes  # padded records
    files = nvme.NvmeFiles(str(tmp_path), shape)
    written = []
    for _ in range(shape.num_layers):
        path, rec_ER = files.layer_file(shape.num_local_experts)
        w13, w2 = nvme.record_views(rec_ER, shape)
        g = torch.Generator().manual_seed(len(written))
        src13 = torch.randn(w13.shape, generator=g).to(dtype)
        src2 = torch.randn(w2.shape, generator=g).to(dtype)
        w13.copy_(src13)  # what the loader does: copy_ into the map
        w2.copy_(src2)
        written.append((path, src13, src2))
        del rec_ER, w13, w2
    files.sync()
    reader = reader_cls()
    host = HostRegion(3 * shape.record_bytes, pin=False)
    slots = host.data.view(3, shape.record_bytes)
    got13, got2 = nvme.record_views(slots, shape)
    for path, src13, src2 in written:
        order = [4, 0, 2]  # out of order, into slots 0..2
        for h, e in enumerate(order):
            reader.submit(slots[h], path, e * shape.record_bytes)
        reader.wait_all()
        for h, e in enumerate(order):
            assert torch.equal(got13[h].view(torch.uint8), src13[e].view(torch.uint8))
            assert torch.equal(got2[h].view(torch.uint8), src2[e].view(torch.uint8))
    reader.close()
    files.close()
    assert list(tmp_path.iterdir()) == []


def test_thread_reader_reports_a_missing_file(tmp_path):
    reader = nvme.ThreadReader(num_threads=2)
    with pytest.raises(FileNotFoundError):
        reader.submit(torch.empty(4096, dtype=torch.uint8), str(tmp_path / "gone.experts"), 0)
    reader.close()


def test_missing_deepspeed_is_said_at_start_up(monkeypatch, caplog):
    def no_aio():
        raise RuntimeError("libaio is missing")

    monkeypatch.setattr(nvme, "DeepSpeedReader", no_aio)
    with caplog.at_level(logging.WARNING, logger="moe_infer.offload.nvme"):
        reader = nvme.make_reader("auto")
    assert isinstance(reader, nvme.ThreadReader)
    assert "DeepSpeed async I/O is not available (RuntimeError: libaio is missing)" in caplog.text
    assert "thread-pool reader" in caplog.text
    reader.close()
    with pytest.raises(RuntimeError, match="offload.nvme_reader=deepspeed: libaio is missing"):
        nvme.make_reader("deepspeed")
