"""torchrun worker: greedy generation through the engine on a TP x PP x EP mesh.

    torchrun --nproc-per-node N tests/dist/mesh_worker.py SPEC_JSON OUT_JSON

SPEC_JSON: {"cases": [{"family", "checkpoint", "tp", "pp", "ep", ...engine kwargs, "workload"}]}; the cases whose
mesh has N ranks run here, one engine each (rank 0 drives). Rank 0 writes per case the generated
token ids, preemptions and chunked prefills to OUT_JSON; the test compares them with the single-rank
engine. Every rank checks that it returned the driver's outputs.
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from moe_infer import LLM, SamplingParams  # noqa: E402

_SHARED = [7, 19, 33, 41, 58, 62, 77, 80, 91, 15, 23, 104, 5, 66, 8, 120, 9, 44, 12, 101]
PROMPTS = [_SHARED + [30, 31], [11, 12, 13], _SHARED[:13] + [140, 141, 142, 143, 144, 145], list(range(40, 77))]
MAX_TOKENS = 12
# a tiny cache (16 blocks of 4) forces preemption; a budget of 8 tokens chunks every prompt
ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=16, max_num_batched_tokens=8,
              max_model_len=128, enable_prefix_caching=False)


def world_of(case: dict) -> int:
    tp, ep = case["tp"], case["ep"]
    return case["pp"] * tp * ep // math.gcd(tp, ep)


def static_buffers(llm: LLM) -> None:
    """The graph paths' static buffers on this rank, run eagerly (capture=False: no GPU here): the step's inputs
    received into them over the mesh, the LM head into the decode buffers' logits, a later stage's hidden states
    into their hidden buffer, as under CUDA graphs on a GPU."""
    from moe_infer.engine.cuda_graph import DecodeGraphs
    from moe_infer.engine.extend_graph import ExtendGraphs
    from moe_infer.engine.runner_graphs import graph_lm_head, hidden_in as graph_hidden_in

    runner = llm.engine.runner
    width = -(-runner.max_model_len // runner.block_size)
    hidden_in = graph_hidden_in(runner)
    runner.graphs = DecodeGraphs(runner.model, 4, width, runner.block_size, runner.device, capture=False,
                                 lm_head=graph_lm_head(runner), hidden_in=hidden_in, mesh=True)
    runner.extend_graphs = ExtendGraphs(runner.model, 8, 4, width, runner.block_size, runner.device, capture=False,
                                        last_rows=runner.last_rows, hidden_in=hidden_in, mesh=True)


# workload "dp" (attention data parallelism): more requests than one replica's batch (max_num_seqs 3 a replica),
# shared prefixes for the prefix cache, requests that end at different steps (one replica idle in some steps)
DP_PROMPTS = PROMPTS + [_SHARED + [50, 51, 52], [3, 1, 4, 1, 5], _SHARED[:9] + [99] * 6, [140, 7],
                        _SHARED + [30, 31, 32, 33], list(range(60, 70))]
DP_MAX_TOKENS = [12, 3, 9, 1, 14, 6, 2, 11, 5, 8]
DP_ENGINE = dict(max_num_seqs=3, enable_prefix_caching=True, num_kv_blocks=20)


def generate(llm: LLM, workload: str = "default"):
    if workload == "dp":
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in DP_MAX_TOKENS]
        return llm.generate([{"prompt_token_ids": p} for p in DP_PROMPTS], params, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def engine_kwargs(workload: str = "default") -> dict:
    return {**ENGINE, **(DP_ENGINE if workload == "dp" else {})}


def count_rows(llm: LLM) -> list:
    """A counter of the real rows (padding left out) the first layer of this rank's stage runs attention on: under
    attention data parallelism, the rows of this rank's replica only."""
    from moe_infer.layers.forward_context import current_forward_context

    model = llm.engine.runner.model
    counted = [0]

    def hook(module, args):
        valid = current_forward_context().valid_T
        counted[0] += int(args[0].shape[0] if valid is None else valid.sum())

    model.layers[model.local_layers[0]].self_attn.register_forward_pre_hook(hook)
    return counted


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    with open(spec_path) as f:
        cases = [c for c in json.load(f)["cases"] if world_of(c) == world]
    results = []
    for case in cases:
        kwargs = {k: v for k, v in case.items() if k not in ("family", "checkpoint", "static_buffers", "workload")}
        workload = case.get("workload", "default")
        llm = LLM(model=case["checkpoint"], **{**engine_kwargs(workload), **kwargs})
        if case.get("static_buffers"):
            static_buffers(llm)
        rows = count_rows(llm) if case.get("dp_attention") else None
        outs = generate(llm, workload)
        runner = llm.engine.runner
        runs = [getattr(g, "runs", 0) for g in (runner.graphs, runner.extend_graphs)]
        sched = llm.engine.scheduler
        tokens = [o.outputs[0].token_ids for o in outs]
        reasons = [o.outputs[0].finish_reason for o in outs]
        if rank == 0:
            results.append({"case": case, "tokens": tokens, "finish": reasons, "preemptions": sched.num_preemptions,
                            "chunked": sched.num_chunked_prefills, "load": llm.get_expert_load(),
                            "replica_tokens": getattr(sched, "num_scheduled_tokens", None),
                            "prefix_hits": llm.engine.get_stats().num_prefix_hits,
                            "replica_preemptions": [r.num_preemptions for r in getattr(sched, "replicas", [])]})
        if rows is not None:  # the test parses it: this rank's replica ran these real rows
            print(f"rank {rank} replica {llm.engine.parallel.replica} real rows {rows[0]}", flush=True)
        print(f"rank {rank} case {case['family']} tp={case['tp']} pp={case['pp']} ep={case['ep']}"
              f"{' static buffers' if case.get('static_buffers') else ''}: {len(outs)} outputs, buffer runs "
              f"{runs[0]} decode {runs[1]} prefill", flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "results": results}, f)
        print(f"MESH DONE {len(results)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
