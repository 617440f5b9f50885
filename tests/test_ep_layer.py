"""EP MoE layer == single-rank MoE layer under torchrun on gloo (2 and 4 ranks).

The worker (tests/dist/ep_layer_worker.py) runs every case: exact / capacity dispatcher, overlap
on / off, with / without a replica placement file, own / replicated tokens, float32 / bfloat16,
dropless / drop / reroute policies, torch experts through the regroup path and the fused
reference through the no-regroup path; dropped rows must equal the policy's; mismatched micro-batch
counts must raise on every rank.
"""
import pytest

from tests.dist.launch import torchrun

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("nproc", [2, 4])
def test_ep_layer_equals_single_rank(nproc):
    rc, out = torchrun(nproc, "ep_layer_worker.py")
    assert rc == 0 and "EP LAYER OK 160" in out, out[-4000:]
