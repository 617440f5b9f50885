"""torchrun worker: greedy generation with experts split over the ranks AND offloaded on each rank.

    torchrun --nproc-per-node N tests/dist/offload_ep_worker.py CHECKPOINT OUT_JSON PLACEMENT_JSON NVME_DIR

Each rank caches its own experts (its stores cover the dispatcher's local slots); rank 0 writes the
tokens of each case to OUT_JSON for the test to compare with the single-rank resident engine.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ep_engine_worker import PROMPTS, engine_kwargs  # noqa: E402
from moe_infer import LLM, SamplingParams  # noqa: E402

CASES = [  # (dispatcher, overlap, replicas, offload kwargs)
    ("exact", False, False, dict(offload="cpu", slots_per_layer=1, miss_policy="wait")),
    ("exact", True, True, dict(offload="cpu", slots_per_layer=2, miss_policy="cpu", cache_policy="lfu")),
    ("exact", True, False, dict(offload="nvme", nvme_reader="threads", slots_per_layer=1, stream_fraction=0.3)),
]


def main() -> int:
    checkpoint, out, placement, nvme_dir = sys.argv[1:5]
    rank = int(os.environ["RANK"])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    for dispatcher, overlap, replicas, offload in CASES:
        if offload["offload"] == "nvme":
            offload = dict(offload, nvme_path=nvme_dir)
        llm = LLM(model=checkpoint, **engine_kwargs("cpu", "float32"), ep=int(os.environ["WORLD_SIZE"]),
                  dispatcher=dispatcher, overlap=overlap, overlap_min_mb=0,
                  placement_file=placement if replicas else None, **offload)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        total = llm.get_offload_stats()["total"]
        results.append({"case": [dispatcher, overlap, replicas, offload["offload"]],
                        "tokens": [o.outputs[0].token_ids for o in outs],
                        "needed": total["needed"], "hits": total["hits"]})
        llm.engine.runner.offload.close()  # the process group outlives this LLM: only the stores go
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
        print(f"OFFLOAD EP DONE {len(results)}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
