"""GPU worker: greedy generation under mesh layouts with CUDA graphs, and the collectives the graphs captured.

    python tests/dist/mesh_gpu_worker.py SPEC_JSON OUT_JSON                          # world 1: parallel.force_mesh
    torchrun --nproc-per-node N tests/dist/mesh_gpu_worker.py SPEC_JSON OUT_JSON     # the layouts of N ranks

SPEC_JSON: {"checkpoint", "layouts": [[tp, pp, ep], ...]} (a 4th entry 1: parallel.dp_attention). Per layout
of this world size every rank builds the engine on its GPU (float32), the driver generates; every torch.distributed
collective called while the current stream is being captured into a CUDA graph is counted (on each rank). Rank 0
writes per layout the tokens, the decode / prefill graph replays, the captured collectives of every rank and whether
the driver scheduled ahead.
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moe_infer import LLM, SamplingParams  # noqa: E402

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 9, 30, 3)]
CAPTURED = {"count": 0}


def count_captured() -> None:
    """Wrap the collectives the model runs: count the calls made while a CUDA graph is being captured."""
    import moe_infer.layers.tensor_parallel as tp_mod

    def wrap(fn):
        def call(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                CAPTURED["count"] += 1
            return fn(*args, **kwargs)
        return call

    dist.all_reduce = wrap(dist.all_reduce)
    tp_mod._all_gather_single = wrap(tp_mod._all_gather_single)
    tp_mod._reduce_scatter_single = wrap(tp_mod._reduce_scatter_single)


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    with open(spec_path) as f:
        spec = json.load(f)
    count_captured()
    results = []
    for layout in spec["layouts"]:
        tp, pp, ep = layout[:3]
        dp_attention = len(layout) > 3 and bool(layout[3])
        if pp * tp * ep // math.gcd(tp, ep) != world:
            continue
        CAPTURED["count"] = 0
        llm = LLM(model=spec["checkpoint"], dtype="float32", device="cuda", block_size=16, num_kv_blocks=256,
                  max_num_seqs=8, max_num_batched_tokens=256, tp=tp, pp=pp, ep=ep, force_mesh=world == 1,
                  dp_attention=dp_attention)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        runner = llm.engine.runner
        mine = torch.tensor([CAPTURED["count"], getattr(runner.graphs, "runs", 0),
                             getattr(runner.extend_graphs, "runs", 0)], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=llm.engine.parallel.control_group)
        results.append({"layout": layout, "tokens": [o.outputs[0].token_ids for o in outs],
                        "captured": [int(t[0]) for t in every], "decode_runs": [int(t[1]) for t in every],
                        "prefill_runs": [int(t[2]) for t in every],
                        "lookahead": bool(getattr(llm.engine.executor, "lookahead", False)),
                        "num_layers": runner.arch.num_layers,
                        "replica_tokens": getattr(llm.engine.scheduler, "num_scheduled_tokens", None)})
        print(f"rank {rank} layout tp={tp} pp={pp} ep={ep}: {CAPTURED['count']} collectives captured", flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
        print(f"MESH GPU DONE {len(results)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
