"""The reduce dispatcher's compute/communication overlap: `ShardGroup.all_reduce_async` (single process, the
collective replaced by a recorder), and the overlapped MoE layer against the same layer unsplit (torchrun, gloo,
2 ranks: tests/dist/reduce_overlap_worker.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_infer.layers.tensor_parallel import SINGLE, ShardGroup
from moe_infer.parallel.health import MeshError
from tests.dist.launch import torchrun


class FakeWork:
    def __init__(self, x, fail: bool = False):
        self.x, self.fail, self.waited = x, fail, False

    def wait(self):
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        self.waited = True
        self.x.mul_(2)  # "the other rank held the same": the sum lands at the wait


def test_all_reduce_async_runs_where_all_reduce_does(monkeypatch):
    """A group of one rank is silent unless `always` (parallel.force_mesh); the sum is there once wait() returns."""
    works = []

    def fake_all_reduce(x, group=None, async_op=False):
        assert async_op and group == "g"
        works.append(FakeWork(x))
        return works[-1]

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    x = torch.ones(3)
    assert SINGLE.all_reduce_async(x).wait() is x and not works
    assert ShardGroup("g", 0, 1).all_reduce_async(x).wait() is x and not works  # one rank, not forced
    pending = ShardGroup("g", 0, 1, always=True).all_reduce_async(x)
    assert len(works) == 1 and not works[0].waited
    assert pending.wait() is x and works[0].waited and torch.equal(x, torch.full((3,), 2.0))
    pending = ShardGroup("g", 1, 2).all_reduce_async(x)
    assert len(works) == 2 and pending.wait() is x


@pytest.mark.parametrize("fail_at", ["start", "wait"])
def test_all_reduce_async_failure_raises_the_mesh_error(monkeypatch, fail_at):
    """A failure when the all-reduce starts or when it is waited for goes through on_error, in the words of the
    blocking all_reduce's failure."""
    def fake_all_reduce(x, group=None, async_op=False):
        if fail_at == "start" or not async_op:
            raise RuntimeError("Connection closed by peer")
        return FakeWork(x, fail=True)

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    seen = []
    shard = ShardGroup("g", 0, 2, on_error=lambda what, err: (seen.append(what), MeshError(f"rank 1: {err}"))[1])
    with pytest.raises(MeshError, match="rank 1: Connection closed"):
        shard.all_reduce_async(torch.ones(2)).wait()
    with pytest.raises(MeshError, match="rank 1: Connection closed"):
        shard.all_reduce(torch.ones(2))
    assert len(seen) == 2 and seen[0] == seen[1]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_overlapped_reduce_layer_equals_unsplit_with_m_all_reduces():
    rc, out = torchrun(2, "reduce_overlap_worker.py", timeout=280)
    assert rc == 0 and "REDUCE OVERLAP OK 12" in out, out[-4000:]
