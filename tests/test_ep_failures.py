"""A mismatched config, a dead rank and a hung rank give clear errors under torchrun, not hangs."""
import re

import pytest

from tests.dist.launch import torchrun

pytestmark = pytest.mark.distributed


def test_config_mismatch_names_the_field_on_every_rank():
    rc, out = torchrun(2, "ep_failure_worker.py", "config_mismatch", timeout=60)
    assert rc != 0
    for rank in (0, 1):
        assert f"rank {rank} raised: ranks were started with different configs: parallel.dispatcher" in out, out[-3000:]


@pytest.mark.parametrize("mode", ["dead_rank", "hung_rank"])
def test_peer_failure_raises_within_the_timeout(mode):
    rc, out = torchrun(2, "ep_failure_worker.py", mode, timeout=90)
    assert rc != 0
    m = re.search(r"rank 0 raised after ([0-9.]+) s: EP all-to-all failed on rank 0 \(ranks \[0, 1\]\): (.*)", out)
    assert m, out[-3000:]
    assert float(m.group(1)) < 15.0  # the 3 s collective timeout (+ 2 s grace, load), not rank 1's 20 s
    cause = "its connection closed: the process died" if mode == "dead_rank" else "hung or dead"
    assert m.group(2).startswith(f"rank 1 did not reach it ({cause}"), m.group(0)
