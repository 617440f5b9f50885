"""torchrun worker: greedy generation through the engine with experts split over the ranks.

    torchrun --nproc-per-node N tests/dist/ep_engine_worker.py CHECKPOINT OUT_JSON PLACEMENT_JSON [--device cuda]

Every rank builds the engine (rank 0 drives, the others serve its steps); for each case (dispatcher
x overlap x replica placement x routing policy) rank 0 writes the generated token ids to OUT_JSON,
which the test compares with the single-rank engine. All ranks must return the driver's outputs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from moe_infer import LLM, SamplingParams  # noqa: E402
from moe_infer.models.hf_config import load_arch  # noqa: E402
from moe_infer.parallel import replicate_hot_experts  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(3, 30)), [8, 9, 10, 11, 12], [40, 41]]
CASES = [  # (dispatcher, overlap, replicas, policy)
    ("exact", False, False, "dropless"),
    ("exact", True, False, "dropless"),
    ("exact", True, True, "dropless"),
    ("capacity", False, False, "drop"),
    ("capacity", True, True, "drop"),
    ("capacity", True, False, "reroute"),
    ("reduce", False, False, "dropless"),  # no tokens move: local experts on every token, one all-reduce
    ("reduce", False, True, "dropless"),  # replicated experts: replica n mod M computes routed row n
    ("reduce", False, False, "drop"),
    ("reduce", True, False, "dropless"),  # overlap_min_mb=0: every step of 2+ tokens as micro-batches (token chunks)
    ("reduce", True, True, "drop"),
]


def engine_kwargs(device: str, dtype: str) -> dict:
    return dict(dtype=dtype, device=device, block_size=4, num_kv_blocks=96, max_model_len=64,
                max_num_batched_tokens=24)  # 24: the long prompt is prefilled in chunks


def write_placement(checkpoint: str, ep: int, path: str) -> str:
    """Hot experts 0, 3, 6 get a replica each (ep redundant slots)."""
    arch, _ = load_arch(checkpoint)
    load_E = [1.0 + 5.0 * (e % 3 == 0) for e in range(arch.num_experts)]
    with open(path, "w") as f:
        f.write(replicate_hot_experts(load_E, ep, num_redundant=ep).to_json())
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("placement", help="placement file with replicas (see write_placement); the same on every rank")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    placement_path = args.placement
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    llm = None
    for dispatcher, overlap, replicas, policy in CASES:
        llm = LLM(model=args.checkpoint, **engine_kwargs(args.device, args.dtype), ep=world, dispatcher=dispatcher,
                  overlap=overlap, overlap_min_mb=0, placement_file=placement_path if replicas else None,
                  policy=policy, capacity_factor=1.0, min_capacity=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        load = llm.get_expert_load()
        results.append({"case": [dispatcher, overlap, replicas, policy], "tokens": tokens,
                        "dropped": sum(sum(r["dropped"]) for r in load)})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": world, "results": results}, f)
        print(f"EP ENGINE DONE {len(results)}")
    else:
        print(f"rank {rank} returned the driver's outputs for {len(results)} cases")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
