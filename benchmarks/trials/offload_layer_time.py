"""Trial: where one offload decode step's host time goes, per miss policy (auto vs share).

The Mixtral shape as benchmarks/offload.py sets it up (24 GB, every layer host memory can pin, trace
routing, layer graphs on), or with shape `qwen3` the Qwen3-30B-A3B shape as it sets that up (a 16 GB
expert budget, the model's own router); argv: steps, miss policies, streams, shape, default
8 auto,share 1 mixtral, and optionally the offload `stream_chunk` (experts per stream buffer). For the
decode steps after warm-up, host wall time is split by wrapping the offload calls: fetch (its one
copy to the host = the wait for the GPU, timed apart), gather_cpu_rows (the CPU path's sync and rows
out), cpu_experts (the host's expert compute), prefetch (decisions and copy launches), the rest of
run (slot compute launches, streams), and the step's remainder (the attention parts' graph
replays, norms, router launches, sampling). Prints ms per step for each, then a cProfile of four
more steps (host time by function).
"""
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

import offload as bench  # noqa: E402
from offload_parts import TraceReplay, record_tiny_traces, use_policies  # noqa: E402
from moe_infer import LLM, SamplingParams  # noqa: E402
import moe_infer.offload.fetched as fe  # noqa: E402
import moe_infer.offload.offloaded as off  # noqa: E402

T = defaultdict(float)
N = defaultdict(int)
ACTIVE = [False]
IN_FETCH = [False]


def timed(name, fn):
    def wrapper(*a, **k):
        if not ACTIVE[0] or (name == "sync" and not IN_FETCH[0]):
            return fn(*a, **k)
        t0 = time.perf_counter()
        IN_FETCH[0] = IN_FETCH[0] or name == "fetch"
        try:
            return fn(*a, **k)
        finally:
            IN_FETCH[0] = IN_FETCH[0] and name != "fetch"
            T[name] += time.perf_counter() - t0
            N[name] += 1
    return wrapper


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    policies = sys.argv[2].split(",") if len(sys.argv) > 2 else ["auto", "share"]
    streams = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    shape = sys.argv[4] if len(sys.argv) > 4 else "mixtral"
    chunk = {"stream_chunk": int(sys.argv[5])} if len(sys.argv) > 5 else {}
    torch.cuda.set_per_process_memory_fraction(24 * bench.GiB / torch.cuda.get_device_properties(0).total_memory)
    cfg = bench.shapes(False)[shape]
    if shape == "mixtral":
        cfg.num_hidden_layers = max(1, min(32, bench.host_layers(cfg, 24.0)))
        budget = (24 * bench.GiB - bench.non_expert_bytes(cfg) - 2.5 * bench.GiB) / bench.GiB
    else:  # benchmarks/offload.py's Qwen3 part: its default budget and layer count
        cfg.num_hidden_layers = max(1, min(48, bench.host_layers(cfg, 16.0)))
        budget = 16.0
    d = tempfile.mkdtemp()
    cfg.save_pretrained(d)
    llm = LLM(model=d, load_format="dummy", dtype="bfloat16", device="cuda", offload="cpu", gpu_expert_budget_gb=budget,
              num_kv_blocks=96, block_size=16, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512,
              enable_prefix_caching=False, **chunk)
    moe = llm.engine.runner.model.moe_layers()
    if shape == "mixtral":
        TraceReplay(record_tiny_traces(16, 128, torch.device("cuda")), 8, 2, torch.device("cuda")).install(moe)
    m = llm.engine.runner.offload
    print(f"{shape}, {cfg.num_hidden_layers} layers; {m.plan.describe()}; {m.cost.describe(m.shape.nbytes)}", flush=True)
    off.OffloadedExpertStore.fetch = timed("fetch", off.OffloadedExpertStore.fetch)
    off.OffloadedExpertStore.prefetch = timed("prefetch", off.OffloadedExpertStore.prefetch)
    fe.FetchedExperts._run = timed("run", fe.FetchedExperts._run)
    fe.gather_cpu_rows = timed("gather_cpu_rows", fe.gather_cpu_rows)
    fe.cpu_experts = timed("cpu_experts", fe.cpu_experts)
    torch.Tensor.cpu = timed("sync", torch.Tensor.cpu)  # fetch's one copy to the host: the wait for the GPU
    eng = llm.engine
    for miss in policies:
        use_policies(llm, "saving", miss)
        for i in range(streams):
            eng.add_request({"prompt_token_ids": list(range(100 + 17 * i, 116 + 17 * i))},
                            SamplingParams(temperature=0.0, max_tokens=steps + 12, ignore_eos=True))
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
        m.reset_stats()
        T.clear(), N.clear()
        ACTIVE[0] = True
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        ACTIVE[0] = False
        tot = m.summary()["total"]  # the timed steps only
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(4):
            eng.step()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        profile_text = out.getvalue()
        while eng.has_unfinished_requests():
            eng.step()
        ms = {k: 1e3 * v / steps for k, v in T.items()}
        print(f"\n== misses {miss}: {1e3 * wall / steps:.1f} ms/step, cpu_scale {m.cost.cpu_scale:.2f}, host gap "
              f"{1e3 * m.host_gap_s:.2f} ms, lead {1e3 * m.host_lead_s:.2f} ms, "
              f"hit {tot['hit_rate']:.2f} partial {tot['partial_share']:.2f} shared {tot['shared_share']:.2f} "
              f"cpu {tot['cpu_share']:.2f}, {tot['gb_h2d'] / steps:.2f} GB/step on the link "
              f"({tot['gb_h2d'] / steps / (m.cost.h2d_bytes_per_s / 1e9) * 1e3:.0f} ms of link)")
        fetch_other = ms.get("fetch", 0) - ms.get("sync", 0)
        run_other = ms.get("run", 0) - ms.get("gather_cpu_rows", 0) - ms.get("cpu_experts", 0) - ms.get("prefetch", 0)
        rest = 1e3 * wall / steps - ms.get("fetch", 0) - ms.get("run", 0)
        for name, v in [("fetch: sync (wait for the GPU)", ms.get("sync", 0)), ("fetch: rest", fetch_other),
                        ("run: gather_cpu_rows", ms.get("gather_cpu_rows", 0)), ("run: cpu_experts", ms.get("cpu_experts", 0)),
                        ("run: prefetch", ms.get("prefetch", 0)), ("run: rest", run_other), ("eager layers + rest", rest)]:
            print(f"  {name:34s} {v:7.1f} ms/step")
        print("  calls per step: " + ", ".join(f"{k} {v / steps:.0f}" for k, v in N.items()), flush=True)
        print("  cProfile of 4 more steps (host time by function):\n" + profile_text[profile_text.find("ncalls"):], flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
