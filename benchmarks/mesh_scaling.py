"""Several GPUs against one: the engine under every mesh layout that fits the GPUs at hand, on two model shapes.

    python benchmarks/mesh_scaling.py                 # every GPU this process sees (one GPU: the layouts of degree 1)
    python benchmarks/mesh_scaling.py --tiny          # CPU: gloo, tiny dims, 2 processes (a smoke run of every path)

Models (random weights, `model.load_format=dummy`: only a config.json is written):
  small   Qwen3-30B-A3B's layer shape, 8 layers: fits one GPU, so the ratio to one GPU is the test
  large   Qwen3-30B-A3B's widths, 48 layers, 384 experts (~88B parameters, ~177 GB in bf16): its one-GPU row is
          the roofline only
Layouts, each a fresh process group (torchrun) of G ranks running benchmarks/mesh_scaling_worker.py: "one GPU"
(the plain engine) and "mesh x1" (parallel.force_mesh: the mesh's code path at degree 1), in one process in the
order A B B A (the power cap favours whatever runs first); then with N >= 2 GPUs tp=N, ep=N, pp=N, tp=N with ep=N
and "ep=N dp" (attention data parallel: each GPU runs 1/N of the requests with a KV cache of its own), plus
pp=2 x tp=N/2 from 4 GPUs. A layout whose weights would not fit its GPUs is skipped.
Measured per layout (greedy, EOS ignored, random prompt ids, each shape warmed up first):
  decode   batch 1 / 16 / 64 / 256, prompt 128, 128 new tokens: output tok/s of the whole generate call, and the
           decode step time (the call minus a 1-token call of the same prompts, over the 127 other steps)
  prefill  16 prompts x 1024 tokens, 1 new token: prompt tok/s (median of 3)
  raw collectives: all-reduce of [T, D] over the layout's stage at every decode batch (eager and in a CUDA
           graph), the pipeline's point-to-point of [T, D]
Rooflines from rates measured on GPU 0 at the start (device_rates.py): engine_roofline.py's decode model at G x
the HBM rate on G GPUs; % of roofline = tok/s / that. A decode step's communication is estimated as (collectives a
step runs in this layout) x (their raw time at that size). Prints a table, checks the 2-GPU targets where N = 2,
and writes mesh_scaling_<device>_x<N>.json to --out, else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import e2e_generate as e2e  # noqa: E402
from tests.dist.launch import run_tree  # noqa: E402
from device_rates import measure_rates  # noqa: E402
from engine_roofline import decode_roofline_s, layer_weight_bytes, prefill_limit_s  # noqa: E402

SMALL = dict(e2e.REAL, num_hidden_layers=8)
LARGE = dict(e2e.REAL, num_hidden_layers=48, num_experts=384)
TINY = dict(e2e.TINY, num_hidden_layers=4)
TINY_LARGE = dict(e2e.TINY, num_hidden_layers=6, num_experts=16)


def weight_bytes(dims: dict) -> float:
    """All weights in bf16 (every expert)."""
    V, D = dims["vocab_size"], dims["hidden_size"]
    return dims["num_hidden_layers"] * layer_weight_bytes(dims, dims["num_experts"]) + 2 * 2 * V * D


# ------------------------------------------------------------------ layouts
def layouts(num_gpus: int) -> list:
    """(name, tp, pp, ep) of every layout measured with num_gpus GPUs (one-GPU rows first)."""
    rows = [("one GPU", 1, 1, 1), ("mesh x1", 1, 1, 1)]
    n = num_gpus
    if n >= 2:
        rows += [(f"tp={n}", n, 1, 1), (f"ep={n}", 1, 1, n), (f"pp={n}", 1, n, 1), (f"tp={n} ep={n}", n, 1, n),
                 (f"ep={n} dp", 1, 1, n)]  # "dp": parallel.dp_attention, each GPU's attention its own requests
    if n >= 4:
        rows += [(f"pp=2 tp={n // 2}", n // 2, 2, 1)]
    return rows


def world(tp: int, pp: int, ep: int) -> int:
    import math

    return pp * tp * ep // math.gcd(tp, ep)


def decode_collectives(dims: dict, tp: int, pp: int, ep: int) -> dict:
    """Collectives a decode step runs in this layout: all-reduces of [B, D] over the stage, point-to-point sends of
    [B, D] between stages (the step's input broadcast and the LM head's all-gather are left out)."""
    L, stage = dims["num_hidden_layers"], world(tp, 1, ep)
    if stage == 1:
        return dict(all_reduce=0, p2p=pp - 1)
    per_layer = 2 if tp > 1 else 1  # attention's o_proj (tp) + the MoE layer's (tp: its experts' F; ep: reduce)
    return dict(all_reduce=L * per_layer + (1 if tp > 1 else 0), p2p=pp - 1)  # + the vocab-parallel embedding


def launch(spec: dict, nproc: int, timeout: float) -> dict:
    """Run one layout's worker (torchrun with nproc ranks, or a plain process at world 1); its JSON."""
    script = os.path.join(HERE, "mesh_scaling_worker.py")
    path = os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path,
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if nproc == 1:
        cmd = [sys.executable, script, json.dumps(spec)]
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
               json.dumps(spec)]
    start = time.perf_counter()
    rc, stdout, stderr = run_tree(cmd, timeout, env=env)  # a timeout kills torchrun's ranks too
    if rc == 124:
        sys.stderr.write(stdout[-3000:] + stderr[-8000:])  # the worker's progress lines and, if it hung, its stacks
        return dict(failed=f"timed out after {timeout:.0f} s")
    proc = subprocess.CompletedProcess(cmd, rc, stdout, stderr)
    print("".join(f"    {line}\n" for line in stdout.splitlines()[-12:] if line.startswith("[")), end="", flush=True)
    if proc.returncode != 0 and os.path.exists(spec["out"]):  # measured, then failed (e.g. in the teardown)
        sys.stderr.write(stderr[-4000:])
        with open(spec["out"]) as f:
            out = json.load(f)
        out["wall_s"], out["exit_code"] = time.perf_counter() - start, proc.returncode
        return out
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        return dict(failed=f"exit code {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}")
    with open(spec["out"]) as f:
        out = json.load(f)
    out["wall_s"] = time.perf_counter() - start
    return out


# ------------------------------------------------------------------ the driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, gloo, tiny dims, 2 processes")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", default="16x1024")
    ap.add_argument("--layouts", default=None, help="comma-separated layout names to run (default: all that fit)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a layout's process may take")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    num = args.gpus or (torch.cuda.device_count() if cuda else 2)
    batches = [1, 4] if args.tiny else [int(b) for b in args.batches.split(",")]
    P, N = (16, 8) if args.tiny else (args.prompt_len, args.new_tokens)
    prefill = (2, 64) if args.tiny else tuple(int(v) for v in args.prefill.split("x"))
    rates = measure_rates(device)
    if cuda:
        torch.cuda.empty_cache()  # the measurement's buffers
    hbm, flops = rates["hbm_gbps"] * 1e9, rates["tflops"] * 1e12
    mem = torch.cuda.get_device_properties(0).total_memory if cuda else 1 << 40
    models = {"small": TINY if args.tiny else SMALL, "large": TINY_LARGE if args.tiny else LARGE}
    label = e2e.device_label(device)
    out_name = f"mesh_scaling_{label}_x{num}.json" if cuda else "mesh_scaling_cpu_gloo_x2.json"
    result = dict(benchmark="mesh_scaling", device=label, gpus=num if cuda else 0, processes=num,
                  torch=torch.__version__, rates=rates, batches=batches, prompt_len=P, new_tokens=N,
                  prefill=list(prefill), models={}, targets=None)
    with tempfile.TemporaryDirectory(prefix="mesh_scaling_") as tmp:
        for model in args.models.split(","):
            dims = models[model]
            ckpt = e2e.write_config(dims, os.path.join(tmp, model))
            rows, fits_one = {}, weight_bytes(dims) < 0.8 * mem
            result["models"][model] = dict(dims=dims, weight_gib=weight_bytes(dims) / 2**30, fits_one_gpu=fits_one,
                                           rows=rows)
            for name, tp, pp, ep in layouts(num):
                G = world(tp, pp, ep)
                if name == "mesh x1" or (args.layouts and name not in args.layouts.split(",")):
                    continue  # "mesh x1" is measured with "one GPU"
                if weight_bytes(dims) / G > 0.8 * mem:
                    rows[name] = dict(skipped=f"{weight_bytes(dims) / G / 2**30:.0f} GiB of weights per GPU do not fit",
                                      gpus=G)
                    continue
                spec = dict(name=name, model=model, dims=dims, ckpt=ckpt, tp=tp, pp=pp, ep=ep, device=device.type,
                            watchdog_s=max(args.timeout - 15, 10),
                            dp_attention=name.endswith(" dp"),
                            batches=batches, prompt_len=P, new_tokens=N, prefill=list(prefill), ab=name == "one GPU",
                            out=os.path.join(tmp, f"{model}_{name.replace(' ', '_').replace('=', '')}.json"))
                print(f"[{model}] {name} ({G} rank{'s' if G > 1 else ''}) ...", flush=True)
                out = launch(spec, G, args.timeout)
                if "failed" in out:  # a layout that fails is a row saying so; the others still run
                    print(f"[{model}] {name} failed: {out['failed']}", flush=True)
                    rows[name] = dict(out, gpus=G)
                    continue
                for row_name, row in out["rows"].items():
                    rows[row_name] = dict(row, tp=tp, pp=pp, ep=ep, gpus=G, raw=out["raw"], wall_s=out["wall_s"],
                                          exit_code=out.get("exit_code", 0))
                e2e.write_result(result, out_name, args.out)  # after every layout: a later timeout keeps these
            add_rooflines(rows, dims, batches, P, N, prefill, hbm, flops, fits_one)
    if num == 2 and cuda:
        result["targets"] = targets(result)
    print_table(result)
    e2e.write_result(result, out_name, args.out)


def add_rooflines(rows: dict, dims: dict, batches, P: int, N: int, prefill, hbm: float, flops: float,
                  fits_one: bool) -> None:
    """Per row: roofline tok/s on its GPUs, % of it, the ratio to one GPU (or to the one-GPU roofline), the decode
    step's estimated communication and compute."""
    one = rows.get("one GPU", {})
    for name, row in rows.items():
        if "failed" in row:
            continue
        if "skipped" in row:  # what it would reach: the roofline of its GPUs
            row["roofline_tok_s"] = {str(b): b * N / decode_roofline_s(dims, b, P, N, hbm * row["gpus"]) for b in batches}
            continue
        G = row["gpus"]
        calls = decode_collectives(dims, row["tp"], row["pp"], row["ep"])
        for b in batches:
            d = row["decode"][str(b)]
            roof = b * N / decode_roofline_s(dims, b, P, N, hbm * G)
            d["roofline_tok_s"], d["of_roofline"] = roof, d["tok_s"] / roof
            base = one.get("decode", {}).get(str(b), {}).get("tok_s") if fits_one else None
            d["vs_one_gpu"] = d["tok_s"] / base if base else None
            if not fits_one:  # the one-GPU row is its roofline
                d["vs_one_gpu_roofline"] = d["tok_s"] / (b * N / decode_roofline_s(dims, b, P, N, hbm))
            raw = row["raw"].get(str(b), {})
            ar = raw.get("all_reduce_graph_s", raw.get("all_reduce_s", 0.0))
            comm_ms = 1e3 * (calls["all_reduce"] * ar + calls["p2p"] * raw.get("p2p_s", 0.0))
            d["comm_ms_est"], d["compute_ms_est"] = comm_ms, max(d["step_ms"] - comm_ms, 0.0)
        seqs, length = prefill
        p = row["prefill"]
        p["limit_tok_s"] = seqs * length / prefill_limit_s(dims, seqs, length, hbm * G, flops * G)
        p["of_limit"] = p["tok_s"] / p["limit_tok_s"]
        base = one.get("prefill", {}).get("tok_s") if fits_one else None
        p["vs_one_gpu"] = p["tok_s"] / base if base else None


def targets(result: dict) -> dict:
    """The 2-GPU issue's targets: each met or missed."""
    small = result["models"].get("small", {}).get("rows", {})
    multi = {n: r for n, r in small.items() if "decode" in r and r["gpus"] > 1}
    out = {}
    failed = [n for n, r in small.items() if "failed" in r]
    if failed:  # a layout that did not run misses "every layout"
        out["layouts_failed"] = dict(value=failed, met=False)
    if multi:
        worst = {b: min(r["decode"][b]["vs_one_gpu"] or 0.0 for r in multi.values()) for b in ("64", "256")
                 if b in next(iter(multi.values()))["decode"]}
        out["every_layout_ge_1x_at_b64_b256"] = dict(value=worst, met=not failed and all(v >= 1.0 for v in
                                                                                      worst.values()))
        for b, goal in (("256", 1.5), ("1", 0.8)):
            ratios = [r["decode"][b]["vs_one_gpu"] for r in multi.values() if r["decode"].get(b, {}).get("vs_one_gpu")]
            if ratios:
                best = max(ratios)
                out[f"best_at_b{b}"] = dict(value=best, goal=goal, met=best >= goal)
    large = result["models"].get("large", {}).get("rows", {})
    fracs = [r["decode"]["64"]["of_roofline"] for r in large.values() if "decode" in r and r["gpus"] > 1
             and "64" in r["decode"]]
    if fracs:
        out["large_b64_of_2gpu_roofline"] = dict(value=max(fracs), goal=0.6, met=max(fracs) >= 0.6)
    return out


def print_table(result: dict) -> None:
    print(f"\n{result['device']}, {result['processes']} rank(s): HBM {result['rates']['hbm_gbps']:.0f} GB/s, "
          f"bf16 {result['rates']['tflops']:.0f} TFLOP/s (measured)")
    for model, m in result["models"].items():
        print(f"\n{model}: {m['weight_gib']:.1f} GiB of weights, {'fits' if m['fits_one_gpu'] else 'does not fit'} one GPU")
        print(f"{'layout':>14} {'batch':>5} {'tok/s':>9} {'vs 1':>6} {'roof %':>7} {'step ms':>8} {'comm ms':>8}")
        for name, row in m["rows"].items():
            if "failed" in row:
                print(f"{name:>14}  failed: {row['failed'][-200:]}")
                continue
            if "skipped" in row:
                roof = ", ".join(f"b{b} {v:.0f}" for b, v in row["roofline_tok_s"].items())
                print(f"{name:>14}  skipped: {row['skipped']} (roofline tok/s: {roof})")
                continue
            for b, d in row["decode"].items():
                vs = d.get("vs_one_gpu") or d.get("vs_one_gpu_roofline")
                print(f"{name:>14} {b:>5} {d['tok_s']:>9.0f} {'-' if vs is None else f'{vs:.2f}':>6} "
                      f"{100 * d['of_roofline']:>6.1f}% {d['step_ms']:>8.2f} {d['comm_ms_est']:>8.2f}")
            if row.get("exit_code"):
                print(f"{name:>14}  measured, then exited with code {row['exit_code']} (its teardown: see the log)")
            p = row["prefill"]
            vs = p.get("vs_one_gpu")
            print(f"{name:>14} {'pf':>5} {p['tok_s']:>9.0f} {'-' if vs is None else f'{vs:.2f}':>6} "
                  f"{100 * p['of_limit']:>6.1f}%")
        for name, row in m["rows"].items():  # the raw collectives of the stage, per layout that has them
            raw = {T: r for T, r in row.get("raw", {}).items() if "all_reduce_s" in r}
            if raw:
                print(f"{name:>14}  all-reduce [T, D], us: T nccl/graph one-shot/graph two-shot/graph")
                for T, r in raw.items():
                    us = [r.get(k) for k in ("all_reduce_s", "all_reduce_graph_s", "symm_one_shot_s",
                                             "symm_one_shot_graph_s", "symm_two_shot_s", "symm_two_shot_graph_s")]
                    print(f"{'':>14}  {T:>6} " + " ".join("-" if v is None else f"{1e6 * v:.1f}" for v in us))
    if result.get("targets"):
        print("\ntargets (2 GPUs):")
        for key, t in result["targets"].items():
            print(f"  {key}: {t['value']} -> {'met' if t['met'] else 'missed'}")


if __name__ == "__main__":
    main()
