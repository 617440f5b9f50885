"""The NVMe tier: expert bytes written through the loader's file map come back exactly, through both
readers (DeepSpeed async I/O and the thread-pool fallback); a missing reader is said at start-up."""
from __future__ import annotations

import logging

import pytest
import torch

from moe_infer.offload import nvme
from moe_infer.offload.host import HostRegion
from moe_infer.offload.plan import ExpertShape
from moe_infer.quant import QuantSpec


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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, "fp8"])
def test_expert_bytes_round_trip_exactly(tmp_path, reader_cls, dtype):
    """Every tensor of an expert's record (fp8: data and scales) comes back from the file as it was written."""
    quant = QuantSpec("fp8", 16, 16) if dtype == "fp8" else None
    shape = ExpertShape(num_layers=2, num_local_experts=5, top_k=2, hidden_size=96, intermediate_size=48,
                        dtype=torch.bfloat16 if quant else dtype, quant=quant)
    assert shape.record_bytes % 4096 == 0 and shape.record_bytes > shape.nbytes  # padded records
    files = nvme.NvmeFiles(str(tmp_path), shape)
    written = []
    for _ in range(shape.num_layers):
        path, rec_ER = files.layer_file(shape.num_local_experts)
        views = nvme.record_views(rec_ER, shape)
        assert len(views) == (4 if quant else 2)
        g = torch.Generator().manual_seed(len(written))
        src = {name: torch.randn(t.shape, generator=g).to(t.dtype) for name, t in views.items()}
        for name, t in views.items():
            t.copy_(src[name])  # what the loader does: copy_ into the map
        written.append((path, src))
        del rec_ER, views
    files.sync()
    reader = reader_cls()
    host = HostRegion(3 * shape.record_bytes, pin=False)
    slots = host.data.view(3, shape.record_bytes)
    got = nvme.record_views(slots, shape)
    for path, src in written:
        order = [4, 0, 2]  # out of order, into slots 0..2
        for h, e in enumerate(order):
            reader.submit(slots[h], path, e * shape.record_bytes)
        reader.wait_all()
        for h, e in enumerate(order):
            for name in src:
                assert torch.equal(got[name][h].view(torch.uint8), src[name][e].view(torch.uint8)), name
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
