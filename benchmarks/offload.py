"""Expert offload on one GPU: decode speed of MoE shapes that do not fit, against the link's limit.

    python benchmarks/offload.py                  # the lent H100: about 6 minutes, one command
    python benchmarks/offload.py --parts mixtral  # the Mixtral shape only (about 2 minutes)
    python benchmarks/offload.py --smoke          # CPU, tiny shapes: the same code paths end to end
    python benchmarks/offload.py --quantization fp8 --parts mixtral,qwen3   # fp8 (block-scaled) experts; or int4, mxfp4

With --quantization the dummy weights are stored as a checkpoint of that format would be (fp8: every linear weight
of the decoder layers but the routers, 128 x 128 blocks; int4: compressed-tensors W4A16, groups of 128; mxfp4: the
experts only, as GPT-OSS): the tiers hold, move and slot the experts with their scales, the budget buys about 2x
(fp8) or 3.5x (4-bit) the bf16 experts, and the bound counts the stored bytes (the bound from the limits' CPU rate,
a bf16 expert's, is left out; the one at the rate timed after the run dequantizes as the engine does).

The engine (`LLM`, continuous batching, paged KV) with `load_format=dummy` (random bf16 weights from config.json),
every expert in pinned host memory (`offload=cpu`), the process limited to --gpu-gb of GPU memory; the expert budget
is what the other weights, the KV cache and a margin leave. Per shape: Mixtral-8x7B (E=8, K=2, D=4096, F=14336; as
many of its 32 layers as host memory can pin, --mixtral-layers), routing (a) from its own router, (b) replayed from
traces of the trained tiny model (its router and pre-gate), 1 and 16 streams; Qwen3-30B-A3B (E=128, K=8, D=2048,
F=768, 48 layers) at --qwen-budget-gb, own router. For each: decode tok/s, hit rate, pre-gate accuracy, GB moved,
achieved H2D GB/s against the pinned limit measured in this run, CPU-computed share, and the time bound the moved
bytes set at the measured link + CPU rates (the limits' CPU rate, timed on a Mixtral expert: Mixtral only; and the
rate timed after each run on one of the shape's own experts). Every single-stream run repeats per value of
--prefetch-rules (`saving,all`), --miss-policies (`auto`, `share`), --layer-graphs and --expert-graphs (`off,on`:
attention parts / a layer step's device experts as CUDA graphs). Baselines in the same run: transformers +
accelerate device_map offload (4 layers at the same GPU memory per layer, extrapolated), and the NVMe tier's reader
against dd (O_DIRECT). Prints a table, writes offload_<device>.json to --out (default $OUT, else benchmarks/results/).
The host's threads spin between layers (OMP_WAIT_POLICY=ACTIVE, one core fewer than the host has, as the engine
core runs them) unless the environment sets a policy.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_infer import host_threads  # noqa: E402  (torch-free)

# OMP_WAIT_POLICY=PASSIVE (or empty: libgomp's default) is the other side of an A/B; OMP_NUM_THREADS (or
# --torch-threads) sets the pool. libgomp reads both when torch loads, so they are set first; the JSON records them.
if host_threads.POLICY_VAR not in os.environ:
    os.environ[host_threads.POLICY_VAR] = "ACTIVE"
    os.environ.setdefault(host_threads.THREADS_VAR, str(max(1, host_threads.host_cores() - 1)))

import torch  # noqa: E402

from offload_parts import (TraceReplay, accelerate_seconds_per_token, disk_read_gbps, host_expert_ms,  # noqa: E402
                           link_and_cpu_limits, print_table, record_tiny_traces, use_policies)
from offload_shapes import (GiB, QUANT_CONFIGS, SMOKE_BLOCK, expert_bytes, host_layers, non_expert_bytes,  # noqa: E402
                            quant_spec, run_streams, shapes)

from moe_infer import LLM  # noqa: E402
from moe_infer.config import OffloadConfig  # noqa: E402
from moe_infer.offload.expert_graphs import ExpertGraphs  # noqa: E402
from moe_infer.offload.prefetch import PREFETCH_RULES  # noqa: E402


def bench_shape(name: str, cfg, budget_gb: float, limits: dict, args, traces, device) -> list:
    """The runs of one shape in one engine."""
    cfg_dir = tempfile.mkdtemp(prefix=f"offload_bench_{name}_")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cfg.save_pretrained(cfg_dir)
    t0 = time.perf_counter()
    llm = LLM(model=cfg_dir, load_format="dummy", dtype="bfloat16", device=str(device), offload="cpu",
              gpu_expert_budget_gb=budget_gb, num_kv_blocks=96, block_size=16, max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=512, enable_prefix_caching=False)
    setup_s = time.perf_counter() - t0
    info = llm.get_offload_stats()
    print(f"[{name}] {info['plan']}\n[{name}] {info['cost']}  (set up in {setup_s:.0f} s)", flush=True)
    moe = llm.engine.runner.model.moe_layers()
    E, K = moe[0].spec.num_experts, moe[0].spec.top_k
    quant, nbytes = quant_spec(cfg), llm.engine.runner.offload.shape.nbytes  # the stored format's bytes
    if nbytes != expert_bytes(cfg):
        raise RuntimeError(f"the engine's expert is {nbytes} bytes, the bound's {expert_bytes(cfg)}")
    link_bps = limits["h2d_gbps"] * 1e9
    rows = []
    for routing in (("router", "trace") if traces is not None else ("router",)):
        if routing == "trace":
            TraceReplay(traces, E, K, device).install(moe)
        runs = [(1, rule) for rule in args.prefetch_rules] + [(16, rule) for rule in args.prefetch_rules_16]
        layer_graphs = llm.engine.runner.layer_graphs
        offload = llm.engine.runner.offload
        # the engine's own graphs (offload.expert_graphs, on by default on CUDA); on CPU, the same static-buffer
        # path without capture, so that the smoke run covers it
        expert_graphs = offload.expert_graphs or (ExpertGraphs(offload.device, capture=False)
                                                  if any(args.expert_graphs) else None)
        for (streams, rule), miss, graphs, eg in [(run, miss, g, eg) for run in runs for miss in args.miss_policies
                                                  for g in args.layer_graphs for eg in args.expert_graphs]:
            if time.perf_counter() > args.deadline:
                print(f"[{name}] time budget spent: {routing} x {streams} skipped", flush=True)
                continue
            use_policies(llm, rule, miss)
            llm.engine.runner.layer_graphs = layer_graphs if graphs else None
            offload.expert_graphs = expert_graphs if eg else None
            replays_before = expert_graphs.replays if expert_graphs is not None else 0
            r = run_streams(llm, streams, args.new_tokens, cfg.vocab_size)
            r["cpu_scale"] = llm.engine.runner.offload.cost.cpu_scale  # the CPU side's in-engine factor, at the end
            moved = (r["copied"] + r["streamed"] + r["cpu"] + r["shared"] + r["partial_missing"]) * nbytes
            # the bound at the CPU rate of the limits above (timed once, on a Mixtral expert: the Mixtral shape's)
            # and at the rate timed right after this run on one of this shape's own experts in the host tier
            # (the host's speed moved by up to 2x between processes on one machine: docs/offload.md)
            n_rows, key = (8, "cpu_ms_8rows") if streams > 1 else (1, "cpu_ms_1row")
            store0 = offload.stores[0]  # (a quantized expert dequantized per call, as the engine's host path does)
            r["cpu_ms_after_run"] = host_expert_ms(None, None, n_rows, weights=lambda: offload.host_weights(store0, 0))

            def bound(cpu_ms: float) -> float:
                return moved / (link_bps + nbytes / (cpu_ms / 1e3))

            # the limits' CPU rate is a bf16 Mixtral expert's: no bound from it for a quantized one (dequantized)
            bound_s = bound(limits[key]) if name == "mixtral" and quant is None else None
            bound_after_s = bound(r["cpu_ms_after_run"])
            if device.type == "cuda":  # how much of the process's GPU limit the run came to hold
                r["gpu_peak_reserved_gb"] = torch.cuda.max_memory_reserved() / GiB
            r.update(shape=name, routing=routing, quantization=quant.method if quant else "none", expert_bytes=nbytes,
                     prefetch_rule=rule, miss_policy=miss, layers=cfg.num_hidden_layers,
                     layer_graphs=graphs and layer_graphs is not None, expert_graphs=eg,
                     expert_graph_replays=(expert_graphs.replays if expert_graphs is not None else 0) - replays_before,
                     stream_chunk=llm.engine.runner.offload.plan.stream_chunk,
                     budget_gb=budget_gb, setup_s=setup_s,
                     h2d_gbps=r["gb_h2d"] / r["seconds"], h2d_of_limit=r["gb_h2d"] * 1e9 / r["seconds"] / link_bps,
                     bound_step_ms=1e3 * bound_s / max(r["decode_steps"], 1) if bound_s else None,
                     step_over_bound=r["seconds"] / bound_s if bound_s else None,
                     bound_step_ms_after_run=1e3 * bound_after_s / max(r["decode_steps"], 1),
                     step_over_bound_after_run=r["seconds"] / bound_after_s if bound_after_s else None)
            rows.append(r)
            bound_txt = f"{r['bound_step_ms']:.0f} ms" if r["bound_step_ms"] else "-"
            print(f"[{name}] {routing:6s} {streams:2d} streams, prefetch {rule}, misses {miss}, layer graphs "
                  f"{'on' if r['layer_graphs'] else 'off'}, expert graphs {'on' if eg else 'off'}: "
                  f"{r['tok_s']:.2f} tok/s, hit {r['hit_rate']:.2f} (partial {r['partial_share']:.2f}), pre-gate "
                  f"{r['prefetch_token_recall']:.2f}, {r['gb_h2d']:.1f} GB at {r['h2d_gbps']:.1f} GB/s "
                  f"({r['gb_prefetch_wasted']:.1f} GB wasted prefetches), CPU {r['cpu_share']:.2f} (shared "
                  f"{r['shared_share']:.2f}, scale {r['cpu_scale']:.2f}), step {r['step_ms']:.0f} ms vs bound "
                  f"{bound_txt} ({r['bound_step_ms_after_run']:.0f} ms at the host's "
                  f"{r['cpu_ms_after_run']:.2f} ms an expert timed after the run) (stream chunk {r['stream_chunk']})",
                  flush=True)
    llm.shutdown()
    del llm, moe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def nvme_read(args, device) -> dict:
    """The NVMe tier's reader (DeepSpeed if it builds, else threads) vs dd on the same file."""
    from moe_infer.offload.host import HostRegion
    from moe_infer.offload.nvme import NvmeFiles, make_reader
    from moe_infer.offload.plan import ExpertShape

    D, F, n = (4096, 14336, args.nvme_experts) if not args.smoke else (64, 96, 8)
    shape = ExpertShape(1, n, 2, D, F, torch.bfloat16)
    files = NvmeFiles(args.nvme_path, shape)
    path, rec = files.layer_file(n)
    block = (torch.rand(1 << 20) * 255).to(torch.uint8)
    for row in rec:
        for s in range(0, row.numel(), block.numel()):
            row[s:s + block.numel()].copy_(block[:row[s:s + block.numel()].numel()])
    del rec
    files.sync()
    dd = disk_read_gbps(path)
    files.sync()
    reader = make_reader("auto")
    host = HostRegion(2 * shape.record_bytes, pin=device.type == "cuda")
    slots = host.data.view(2, shape.record_bytes)
    t0 = time.perf_counter()
    for e in range(n):
        reader.submit(slots[e % 2], path, e * shape.record_bytes)
        if e % 2:
            reader.wait_all()
    reader.wait_all()
    ours = n * shape.record_bytes / (time.perf_counter() - t0) / 1e9
    reader.close()
    host.release()
    files.close()
    return {"reader": reader.name, "gb": n * shape.record_bytes / 1e9, "read_gbps": ours, "dd_gbps": dd,
            "of_disk": ours / dd}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: test the script end to end")
    ap.add_argument("--gpu-gb", type=float, default=24.0, help="the whole process's GPU memory")
    ap.add_argument("--qwen-budget-gb", type=float, default=16.0)
    ap.add_argument("--mixtral-layers", type=int, default=0, help="0: as many as host memory can pin (<= 32)")
    ap.add_argument("--qwen-layers", type=int, default=0, help="0: as many as host memory can pin (<= 48)")
    ap.add_argument("--new-tokens", type=int, default=0, help="tokens per stream (0: 20, 6 with --smoke)")
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--nvme-experts", type=int, default=12, help="Mixtral experts written and read back (352 MB each)")
    ap.add_argument("--time-budget", type=float, default=360.0, help="seconds; no part or run starts after it")
    ap.add_argument("--parts", default="mixtral,qwen3,accelerate,nvme", help="which parts to run (comma list)")
    ap.add_argument("--prefetch-rules", default="saving,all", help="offload.prefetch_rule of each single-stream run")
    ap.add_argument("--prefetch-rules-16", default="",
                    help="offload.prefetch_rule of each 16-stream run (default: the first of --prefetch-rules)")
    ap.add_argument("--miss-policies", default="auto",
                    help="offload.miss_policy of each run (comma list: each run repeated per policy)")
    for flag, what in (("layer", "each layer's attention part"), ("expert", "a layer step's device experts")):
        ap.add_argument(f"--{flag}-graphs", default="on", help=f"{what} as CUDA graphs: on, off, or off,on (each run "
                        "repeated per value, in that order)")
    ap.add_argument("--reserve-gb", type=float, default=2.5,
                    help="Mixtral: GiB of the --gpu-gb left for activations, graphs and workspaces (the rest of what "
                         "the non-expert weights leave is the expert budget)")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch's intra-op threads for the host's experts, set before any of them runs (a pool made "
                         "smaller later may keep its threads spinning under ACTIVE); 0: as the environment says")
    ap.add_argument("--quantization", default="none", choices=list(QUANT_CONFIGS),
                    help="the experts' (and attention's) stored format (see the docstring)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.torch_threads < 0:
        ap.error("--torch-threads: must be >= 0 (0: torch's default)")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    args.prefetch_rules, args.parts = args.prefetch_rules.split(","), args.parts.split(",")
    args.miss_policies = args.miss_policies.split(",")
    for flag in ("layer_graphs", "expert_graphs"):
        if any(v not in ("on", "off") for v in getattr(args, flag).split(",")):
            ap.error(f"--{flag.replace('_', '-')}: on, off, or off,on; got {getattr(args, flag)!r}")
        setattr(args, flag, [v == "on" for v in getattr(args, flag).split(",")])
    for miss in args.miss_policies:
        OffloadConfig(store="cpu", miss_policy=miss)
    args.prefetch_rules_16 = args.prefetch_rules_16.split(",") if args.prefetch_rules_16 else args.prefetch_rules[:1]
    for rule in args.prefetch_rules:  # a typo fails here, not after minutes of set-up
        PREFETCH_RULES.get(rule)
    unknown = set(args.parts) - {"mixtral", "qwen3", "accelerate", "nvme"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}; choose from mixtral, qwen3, accelerate, nvme")
    start = time.perf_counter()
    args.deadline = start + args.time_budget
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    args.new_tokens = args.new_tokens or (6 if args.smoke else 20)
    shp = shapes(args.smoke)
    mix, qwen = shp["mixtral"], shp["qwen3"]
    qcfg = QUANT_CONFIGS[args.quantization]
    if args.smoke and args.quantization == "fp8":  # blocks that divide the tiny shapes' widths
        qcfg = dict(qcfg, weight_block_size=[SMOKE_BLOCK] * 2)
    if args.smoke and args.quantization == "int4":
        qcfg = copy.deepcopy(qcfg)
        qcfg["config_groups"]["group_0"]["weights"]["group_size"] = SMOKE_BLOCK
    for c in (mix, qwen) if qcfg is not None else ():
        c.quantization_config = qcfg
    result = {"benchmark": "offload", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "git_commit": os.environ.get("GIT_COMMIT"), "smoke": args.smoke,
              "gpu_gb": args.gpu_gb,
              "omp_wait_policy": os.environ["OMP_WAIT_POLICY"] or "libgomp default (set empty)",
              "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.gpu_gb * GiB / torch.cuda.get_device_properties(0).total_memory)
    limits = link_and_cpu_limits(mix.hidden_size, mix.intermediate_size, torch.bfloat16, device)
    result["limits"] = limits
    print(f"limits: pinned H2D {limits['h2d_gbps']:.1f} GB/s for one {limits['expert_mb']:.0f} MB expert; CPU "
          f"{limits['cpu_ms_1row']:.2f} ms (1 row) / {limits['cpu_ms_8rows']:.2f} ms (8 rows) per expert on "
          f"{torch.get_num_threads()} threads", flush=True)
    traces = record_tiny_traces(16, 64 if args.smoke else 128, device)
    if not args.smoke:  # as many layers as host memory can pin, keeping room for the baseline and the OS
        mix.num_hidden_layers = args.mixtral_layers or max(1, min(32, host_layers(mix, 24.0)))
        qwen.num_hidden_layers = args.qwen_layers or max(1, min(48, host_layers(qwen, 16.0)))
    result["notes"] = [f"Mixtral shape with {mix.num_hidden_layers} of 32 layers (host memory for pinning)",
                       f"Qwen3 shape with {qwen.num_hidden_layers} of 48 layers"]
    mix_budget = ((args.gpu_gb * GiB - non_expert_bytes(mix) - args.reserve_gb * GiB) / GiB if not args.smoke
                  else 0.3 * mix.num_hidden_layers * 8 * expert_bytes(mix) / GiB)
    qwen_budget = (args.qwen_budget_gb if not args.smoke
                   else 0.3 * qwen.num_hidden_layers * 16 * expert_bytes(qwen) / GiB)
    tag = "smoke_cpu" if args.smoke else result["device"].replace("NVIDIA ", "").replace(" ", "_").lower()
    if qcfg is not None:
        tag += f"_{args.quantization}"
    result["quantization"] = args.quantization
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"offload_{tag}.json")
    result["runs"], result["errors"] = [], {}
    acc_layers, full_layers = (2, mix.num_hidden_layers) if args.smoke else (4, 32)

    def accelerate_part() -> None:
        acc = copy.deepcopy(mix)
        acc.num_hidden_layers = acc_layers
        acc.quantization_config = None  # the baseline runs transformers' bf16 model
        s = accelerate_seconds_per_token(acc, int(mix_budget * GiB * acc_layers / full_layers + 1.2 * GiB), device)
        result["accelerate"] = {"layers": acc_layers, "s_per_token": s,
                                "extrapolated_tok_s": 1.0 / (s * full_layers / acc_layers)}
        print(f"accelerate device_map: {s:.2f} s/token for {acc_layers} layers -> "
              f"{result['accelerate']['extrapolated_tok_s']:.3f} tok/s for {full_layers}", flush=True)

    def nvme_part() -> None:
        n = result["nvme"] = nvme_read(args, device)
        print(f"NVMe ({n['reader']}): {n['read_gbps']:.2f} GB/s vs dd {n['dd_gbps']:.2f} GB/s ({n['of_disk']:.0%})",
              flush=True)

    def shape_part(name, cfg, budget, traces_):
        return lambda: result["runs"].extend(bench_shape(name, cfg, budget, limits, args, traces_, device))

    parts = [("mixtral", shape_part("mixtral", mix, mix_budget, traces)),
             ("qwen3", shape_part("qwen3", qwen, qwen_budget, None)),
             ("accelerate", accelerate_part), ("nvme", nvme_part)]
    for name, fn in parts:  # one failing part is recorded and the others still run: this is a one-shot GPU run
        if name not in args.parts:
            continue
        if time.perf_counter() > args.deadline:
            result["errors"][name] = "skipped: --time-budget spent"
            print(f"{name}: skipped, the time budget is spent", flush=True)
            continue
        try:
            fn()
        except Exception as err:  # noqa: BLE001
            result["errors"][name] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        gc.collect()
        result["seconds"] = time.perf_counter() - start
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print_table(result)
    print(f"wrote {out} ({result['seconds']:.0f} s)")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
