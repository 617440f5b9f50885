"""torchrun worker: greedy generation with online expert re-balancing (EPLB) vs without, on N ranks.

    torchrun --nproc-per-node N tests/dist/ep_rebalance_worker.py OUT_JSON PLACEMENT_JSON [--device cuda]

The trained tiny model (skewed routing, so re-plans move experts), EP over all ranks, one replica
slot per rank. For each case (exact, capacity and reduce dispatchers) rank 0 writes the greedy tokens with and
without re-balancing, and (exact dispatcher) with the planner's per-layer placement file plus re-balancing; every
rank checks that after each re-balancing run its slots hold the checkpoint's weights of the experts its layers'
placements name, and counts the slots it received. --device cuda: one GPU a rank, NCCL.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moe_infer import LLM, SamplingParams  # noqa: E402
from moe_infer.assets import default_model_path  # noqa: E402
from moe_infer.models import load_model  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n\ndef walk", "x = ["]
CASES = [("exact", "dropless", False), ("capacity", "drop", False),  # (dispatcher, routing policy,
         ("exact", "dropless", True),  # the planner's per-layer placement file instead of the replicas)
         ("reduce", "dropless", False)]  # no tokens move: the owner tables are rewritten in place


def slots_hold_checkpoint_weights(llm, reference) -> bool:
    ok = True
    for layer, ref_layer in zip(llm.engine.runner.model.moe_layers(), reference.moe_layers()):
        experts = layer.dispatcher.local_expert_ids
        for w, ref in zip(layer.store.weights(), ref_layer.store.weights()):
            ok &= bool(torch.equal(w.cpu(), ref[experts]))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_path")
    ap.add_argument("placement_file")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    out_path, placement_file = args.out_path, args.placement_file
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kwargs = dict(dtype="float32", device=args.device, block_size=4, num_kv_blocks=128, max_model_len=128, ep=world,
                  num_redundant_experts=world, capacity_factor=1.0, min_capacity=2)
    reference = load_model(default_model_path(), torch.float32, "cpu")  # all experts, for the weight check
    results, llm = [], None
    for dispatcher, policy, use_file in CASES:
        tokens = {}
        for eplb in (False, True):
            extra = dict(placement_file=placement_file, num_redundant_experts=0) if eplb and use_file else {}
            llm = LLM(**{**kwargs, **extra}, dispatcher=dispatcher, policy=policy, enable_eplb=eplb,
                      eplb_step_interval=2)
            if eplb and use_file:  # before any re-plan: every layer holds the file's own placement
                first = [list(layer.dispatcher.placement.slots) for layer in llm.engine.runner.model.moe_layers()]
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            tokens[eplb] = [o.outputs[0].token_ids for o in outs]
        reb = llm.engine.runner.rebalancer
        counts = torch.tensor([reb.num_rebalances, reb.slots_moved, int(slots_hold_checkpoint_weights(llm, reference))],
                              device=llm.engine.runner.device)  # NCCL gathers device tensors only
        gathered = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(gathered, counts)
        placements = [list(layer.dispatcher.placement.slots) for layer in llm.engine.runner.model.moe_layers()]
        results.append({"case": [dispatcher, policy, use_file], "tokens": tokens[False], "tokens_eplb": tokens[True],
                        "rebalances": [int(g[0]) for g in gathered], "slots_moved": [int(g[1]) for g in gathered],
                        "weights_ok": [bool(g[2]) for g in gathered], "placements": placements,
                        "file_placements": first if use_file else None})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": world, "results": results}, f)
        print(f"EP REBALANCE DONE {len(results)}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
