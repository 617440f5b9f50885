"""What crosses between the ranks per decode step under tp=2, pp=2, ep=2 and ep=2 with attention data parallelism
(torchrun, gloo): at most one host
message received per rank, the same number for a model of 2 and of 4 layers, and no host read of a tensor in a
step's device work (each would be a host sync on a GPU). The exact all-to-all dispatcher, which reads its split
sizes on the host in every MoE layer, is run too: the counters must see its reads (one per MoE layer and step),
or they would not see one put back anywhere else."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from engine_fixtures import checkpoint  # noqa: E402
from tests.dist.launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# ep2dp: two attention replicas with requests of their own (parallel.dp_attention; 2 and 1 of the 3 prompts)
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "ep2": dict(ep=2), "ep2dp": dict(ep=2, dp_attention=True)}


def test_one_host_message_per_decode_step_and_no_host_sync_in_a_layer(tmp_path):
    ckpts = {n: checkpoint("qwen3_moe", num_hidden_layers=n) for n in (2, 4)}
    cases = [dict(name=f"{name}_L{n}", checkpoint=ckpts[n], **sizes) for name, sizes in LAYOUTS.items() for n in ckpts]
    cases.append(dict(name="ep2_exact_L4", checkpoint=ckpts[4], ep=2, dispatcher="exact"))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    rc, log = torchrun(2, "mesh_messages_worker.py", str(spec), str(tmp_path / "out"), timeout=540)
    assert rc == 0 and log.count("MESSAGES DONE") == 2, log[-4000:]
    ranks = [{r["case"]: r for r in json.loads((tmp_path / f"out.rank{k}.json").read_text())} for k in (0, 1)]
    for rank, results in enumerate(ranks):
        for name in LAYOUTS:
            per_layers = {}
            for n in ckpts:
                r = results[f"{name}_L{n}"]
                steps = r["decode_intervals"]
                assert len(steps) >= 4, (name, n, r["steps"])  # several whole decode steps were seen
                where = f"{name}, {n} layers, rank {rank}"
                assert all(s.get("host_received", 0) <= 1 for s in steps), (where, steps)
                assert all(s.get("host_reads", 0) == 0 for s in steps), (where, steps)
                per_layers[n] = [s.get("host_calls", 0) for s in steps]
                assert r["tokens"] == ranks[0][f"{name}_L{n}"]["tokens"]  # every rank returned the driver's outputs
            assert max(per_layers[4]) == max(per_layers[2]), (name, rank, per_layers)  # nothing per layer
    for name in ("tp2", "ep2", "ep2dp"):  # the driver schedules ahead (pp = 1)
        assert ranks[0][f"{name}_L2"]["async"], name
    for rank, results in enumerate(ranks):
        print(rank, {name: results[f"{name}_L4"]["decode_intervals"][-1] for name in LAYOUTS})
    exact = ranks[0]["ep2_exact_L4"]["decode_intervals"]
    assert all(s.get("host_reads", 0) >= 4 for s in exact), exact  # the exact dispatcher: a read per MoE layer
