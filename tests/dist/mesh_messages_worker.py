"""torchrun worker: what crosses between the ranks in each step of a mesh, counted on every rank.

    torchrun --nproc-per-node 2 tests/dist/mesh_messages_worker.py SPEC_JSON OUT_PREFIX

SPEC_JSON: {"cases": [{"name", "checkpoint", "tp", "pp", "ep", ...engine kwargs}]}. Per case every rank builds the
engine, then counts while the driver generates (one prefill step, then decode steps):
  - every torch.distributed call, by group: "host" on the CPU control groups (gloo: headers, sampled tokens to the
    driver, start-up and end-of-generate messages), "device" on the others; and whether this rank received in it;
  - host reads of tensors (`tolist`, `item`, `cpu`, `numpy`, `bool`/`int`/`float` of a tensor, `nonzero`) made by
    the engine inside a step's device work (the runner's input loading and receiving, placeholder filling, forward
    and sampling), through a TorchFunctionMode; on a GPU each would be a host sync. Reads made by the CPU reference
    experts backend (moe_infer/experts/reference.py: the CPU stand-in of the fused Triton experts, which have none)
    are kept apart.
Events are bucketed by step: the interval after this rank's k-th forward and up to its (k+1)-th holds the end of
step k and the start of step k+1 (header, inputs). Each rank writes OUT_PREFIX.rank{r}.json.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from moe_infer import LLM, SamplingParams  # noqa: E402

HOST_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__", "nonzero"}
DIST_CALLS = ("broadcast", "send", "recv", "isend", "irecv", "all_reduce", "all_gather", "all_gather_into_tensor",
              "all_to_all_single", "all_to_all", "reduce_scatter_tensor", "broadcast_object_list",
              "all_gather_object", "barrier")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
NEW_TOKENS = 8
ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=8)


class Counter:
    def __init__(self, ctx) -> None:
        self.ctx, self.step = ctx, 0
        self.steps = collections.defaultdict(lambda: collections.Counter())  # step -> counts
        self.decode_steps = set()  # steps whose forward was a decode (one token a sequence)

    def host_groups(self):
        return {id(g) for g in (self.ctx.control_group, self.ctx.stage_control_group, self.ctx.results_group)
                if g is not None}

    def dist_call(self, name, args, kwargs):
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        kind = "host" if group is not None and id(group) in self.host_groups() else "device"
        received = name in ("recv", "irecv") or (name == "broadcast" and kwargs.get("src", args[1] if len(args) > 1
                                                                                    else None) != self.ctx.rank)
        received = received or name in ("all_reduce", "all_gather_object", "broadcast_object_list", "all_gather")
        c = self.steps[self.step]
        c[f"{kind}_calls"] += 1
        if received:
            c[f"{kind}_received"] += 1

    def host_read(self, where: str):
        self.steps[self.step]["reference_experts_reads" if where.endswith("experts/reference.py") else "host_reads"] += 1


class HostReads(TorchFunctionMode):
    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            frame = sys._getframe(1)
            while frame is not None and "moe_infer" not in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None:
                self.counter.host_read(frame.f_code.co_filename)
        return func(*args, **(kwargs or {}))


def instrument(llm, counter: Counter) -> None:
    for name in DIST_CALLS:
        orig = getattr(dist, name)

        @functools.wraps(orig)
        def wrapped(*args, _orig=orig, _name=name, **kwargs):
            counter.dist_call(_name, args, kwargs)
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapped)
    runner = llm.engine.runner
    mode = HostReads(counter)

    def watched(obj, name, on_call=None):
        orig = getattr(obj, name)

        def call(*args, **kwargs):
            if on_call is not None:
                on_call(*args)
            with mode:
                return orig(*args, **kwargs)

        setattr(obj, name, call)

    def forward_begins(inputs, *rest):
        counter.step += 1
        if inputs.sizes[4] == 1:
            counter.decode_steps.add(counter.step)

    watched(runner, "forward_step", forward_begins)
    for name in ("sample", "fill_placeholders"):
        watched(runner, name)
    for name in ("load", "receive"):
        watched(runner.paths, name)


def main() -> int:
    spec_path, out_prefix = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    with open(spec_path) as f:
        cases = json.load(f)["cases"]
    results = []
    saved = {name: getattr(dist, name) for name in DIST_CALLS}
    for case in cases:
        kwargs = {k: v for k, v in case.items() if k not in ("name", "checkpoint")}
        llm = LLM(model=case["checkpoint"], **{**ENGINE, **kwargs})
        counter = Counter(llm.engine.parallel)
        instrument(llm, counter)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
        for name, fn in saved.items():
            setattr(dist, name, fn)
        decode = sorted(counter.decode_steps)
        # the intervals that start after one decode forward and end at the next one: whole decode steps
        between = [dict(counter.steps[k]) for k in decode if k + 1 in counter.decode_steps]
        results.append({"case": case["name"], "steps": counter.step, "decode_intervals": between,
                        "tokens": [o.outputs[0].token_ids for o in outs],
                        "async": bool(getattr(llm.engine.executor, "lookahead", False))})
        print(f"rank {rank} case {case['name']}: {counter.step} steps", flush=True)
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(results, f)
    print(f"MESSAGES DONE rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
