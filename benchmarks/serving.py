"""Serving benchmark: the OpenAI server under a request-rate sweep, measured by an existing load generator
(servebench), against the in-process `LLM.generate` on the same load, in one run.

Model: e2e_generate.py's REAL (Qwen3-30B-A3B's layer shape, 4 layers, random weights) with the shipped tiny MoE's
tokenizer copied in and the vocabulary cut to its 6144 ids (every generated token decodes to text; prompts are
text). Each engine runs in its own process: build the checkpoint; offline: warm up (decode batches of every size,
then N other prompts of the saturation shape: first sights compile kernels and capture graphs), then
`LLM.generate` over the saturation load (N prompts of INPUT tokens, OUTPUT tokens each, EOS ignored) -> output
tok/s, the median of --repeats passes (3; each with its own prompts: single passes swung by 10-25 %); server:
`serve()` in a child process, the same warm-up, then servebench at 25/50/75/90 % of the offline request rate
(Poisson arrivals, fresh prompts per level) and at rate=inf with the saturation passes' prompts, median again.
servebench streams /v1/completions with `stream_options.include_usage`, counts tokens from `usage`, and reports
TTFT / TPOT percentiles, output tok/s, goodput (requests/s meeting --slo-ttft-ms and --slo-tpot-ms) and its own
event loop's lag (p99: a client that lags is itself a bound); `--client-procs 1,4` deals the saturation level over
K load generator processes (once per value, the first is the headline).
Target: at saturation the server delivers >= 90 % of the offline output tok/s. A server is an engine loop
(`--engine-loops process,thread`) and a number of API server processes (`--api-server-counts 2,1`, process loop
only): the first gets the rate sweep, the others the saturation level only. The decode roofline (HBM bytes per step
at the copy bandwidth measured on this GPU) is printed for scale; none on the CPU. Both sides run torch with the
same thread count: on the CPU the engine core leaves a core to each HTTP process (moe_infer/engine/core_proc.py),
so OMP_NUM_THREADS is set to that count for the offline child and the server alike.

Why servebench: an OpenAI-compatible load generator with Poisson rate sweeps, goodput and a local HF tokenizer, in
~100 kB; guidellm, inference-perf, aiperf, genai-bench and sglang.bench_serving import `datasets` (pyarrow ~40 MB),
vLLM's `vllm bench` needs vLLM.

    python benchmarks/serving.py [--out X.json]        # H100: ~4 min
    python benchmarks/serving.py --tiny                # CPU: tiny dims, a smoke run (~1 min)

Writes serving_<device>.json to --out (a file or a folder), else $OUT, else benchmarks/results/.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from e2e_generate import REAL, TINY, build_checkpoint, write_result  # noqa: E402
from serving_load import prompts_from, sweep, warm_load, warm_server  # noqa: E402


def copy_bytes_per_s(device: str) -> Optional[float]:
    """The device's measured copy bandwidth (bytes read + written per second, device_rates.py), the decode
    roofline's rate; None on the CPU (no roofline there)."""
    if device == "cpu":
        return None
    from device_rates import measure_rates

    return measure_rates(device)["hbm_gbps"] * 1e9


def bench_threads(device: str, api_server_counts: List[int]) -> Optional[int]:
    """torch's intra-op threads for both sides on the CPU: what the engine core keeps beside the most HTTP
    processes of the run (None on a GPU: the core keeps its default there, as the offline engine does)."""
    if device != "cpu":
        return None
    return int(os.environ["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in os.environ else max(
        1, (os.cpu_count() or 1) - max(api_server_counts))


def engine_kwargs(args) -> dict:
    return dict(device=args.device, dtype="float32" if args.device == "cpu" else "bfloat16",
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(4096, args.input_len),
                max_model_len=args.input_len + args.output_len + 64)


# ---------------------------------------------------------------------- child processes
def _build(dims: dict, device: str, out_dir: str) -> None:
    import torch

    build_checkpoint(dims, torch.float32 if device == "cpu" else torch.bfloat16, torch.device(device), out_dir)
    from moe_infer.assets import default_model_path

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_path(), name), out_dir)


def _offline(ckpt: str, kw: dict, warm: list, warm_prompts: list, prompt_sets: list, output_len: int, queue) -> None:
    """LLM.generate over each prompt set in turn (fresh prompts each: the prefix cache gives a pass nothing);
    output_tok_s is the median pass's."""
    import torch

    from moe_infer import LLM, SamplingParams

    llm = LLM(model=ckpt, **kw)
    llm.generate([p for p, _ in warm], [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for _, n in warm],
                 use_tqdm=False)
    sync = torch.cuda.synchronize if kw["device"] != "cpu" else (lambda: None)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    # a load of the saturation load's shape first, untimed: its prefill shapes compile Triton kernels and
    # capture graphs on first sight (a fresh machine's first pass measured 8.9k tok/s, the next ones 18-20k,
    # 2026-11-24); other prompts than the timed ones, so that the prefix cache gives the timed pass nothing
    llm.generate(warm_prompts, params, use_tqdm=False)
    sync()
    passes = []
    for prompts in prompt_sets:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        elapsed = time.perf_counter() - start
        bad = [o.outputs[0].error for o in outs if o.outputs[0].finish_reason != "length"]
        assert not bad, f"{len(bad)} offline requests failed: {bad[0]}"
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        passes.append(dict(elapsed_s=elapsed, output_tokens=tokens, output_tok_s=tokens / elapsed,
                           prompt_tokens=sum(len(o.prompt_token_ids) for o in outs)))
    median = sorted(passes, key=lambda p: p["output_tok_s"])[len(passes) // 2]
    queue.put(dict(median, repeats_output_tok_s=[p["output_tok_s"] for p in passes],
                   device=torch.cuda.get_device_name() if kw["device"] != "cpu" else "cpu", torch=torch.__version__,
                   torch_threads=torch.get_num_threads(), copy_bytes_per_s=copy_bytes_per_s(kw["device"])))


def _server(ckpt: str, kw: dict, port: int, max_queued: int, switch_s: float, engine_loop: str,
            api_servers: int) -> None:
    from moe_infer.engine.llm import build_config
    from moe_infer.server.config import ServeConfig
    from moe_infer.server.launch import serve

    serve(build_config(model=ckpt, **kw), ServeConfig(port=port, log_level="warning", served_model_name="bench",
                                                      max_queued_requests=max_queued, gil_switch_interval_s=switch_s,
                                                      engine_loop=engine_loop, api_server_count=api_servers))


def run_child(target, *args, with_queue: bool = False):
    """target(*args[, queue]) in a fresh (spawned) process: (process, queue)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue() if with_queue else None
    proc = ctx.Process(target=target, args=(*args, queue) if with_queue else args)
    proc.start()
    return proc, queue


def wait_healthy(url: str, proc, timeout: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise RuntimeError(f"the server process exited with {proc.exitcode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def decode_roofline_tok_s(dims: dict, batch: int, context: int, bytes_per_s: Optional[float]) -> Optional[float]:
    """Tokens/s if a decode step of `batch` sequences only read its bytes at bytes_per_s (engine_roofline.py's
    decode_step_bytes); None without a measured rate (the CPU)."""
    from engine_roofline import decode_step_bytes

    return None if bytes_per_s is None else batch * bytes_per_s / decode_step_bytes(dims, batch, context)


def summary_row(rate: float, level) -> dict:
    s = level.summary
    ms = lambda st, q: None if getattr(st, q) is None else getattr(st, q) * 1000  # noqa: E731
    return dict(rate=rate, sent=len(level.requests), completed=s.completed, failed=s.failed, errors=s.errors,
                duration_s=s.duration, output_tok_s=s.output_throughput, request_s=s.request_throughput,
                goodput_req_s=s.goodput, slo_attainment=s.slo_attainment,
                ttft_p50_ms=ms(s.ttft, "p50"), ttft_p99_ms=ms(s.ttft, "p99"),
                tpot_p50_ms=ms(s.tpot, "p50"), tpot_p99_ms=ms(s.tpot, "p99"), itl_p99_ms=ms(s.itl, "p99"),
                client_lag_p99_ms=level.client_lag_p99_ms, client_start_spread_s=getattr(level, "start_spread_s", None),
                repeats_output_tok_s=getattr(level, "repeats_output_tok_s", None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU (a smoke run)")
    ap.add_argument("--num-requests", type=int, default=None, help="the saturation load (default 512; tiny 64)")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 256; tiny 32)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens (default 128; tiny 16)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default 128; tiny 16")
    ap.add_argument("--rate-fractions", default="0.25,0.5,0.75,0.9", help="of the offline request rate")
    ap.add_argument("--level-s", type=float, default=None, help="seconds of arrivals per rate (default 15; tiny 4)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--gil-switch-interval-s", type=float, default=_serve_default("gil_switch_interval_s"))
    ap.add_argument("--engine-loops", default="process",
                    help="serve.engine_loop values, comma-separated: the first gets the rate sweep, the others the "
                         "saturation level only (e.g. process,thread: the engine core process against the thread)")
    ap.add_argument("--api-server-counts", default="1",
                    help="serve.api_server_count values for engine_loop=process, comma-separated (after the first "
                         "server: the saturation level only)")
    ap.add_argument("--client-procs", default="1",
                    help="load generator processes for the saturation level (its requests dealt over them), "
                         "comma-separated: the level runs once per value on each server, the first is the headline")
    ap.add_argument("--repeats", type=int, default=3,
                    help="saturation passes, offline and per server, each with its own prompts: the median counts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.client_procs = [int(k) for k in str(args.client_procs).split(",")]
    tiny = args.tiny
    args.device = "cpu" if tiny else "cuda"
    args.num_requests = args.num_requests or (64 if tiny else 512)
    args.input_len = args.input_len or (32 if tiny else 256)
    args.output_len = args.output_len or (16 if tiny else 128)
    args.max_num_seqs = args.max_num_seqs or (16 if tiny else 128)
    args.level_s = args.level_s or (4.0 if tiny else 15.0)
    # the vocabulary is the tokenizer's 6144 ids: a random model over Qwen3's 151936 ids mostly samples ids
    # the tiny tokenizer cannot decode, and a stream of empty text is what a client sees as an empty response
    # (the first H100 run, 2026-11-23: 80 % of the requests "failed" that way; the offline count was by ids)
    dims = dict(TINY if tiny else REAL, vocab_size=6144)
    kw = engine_kwargs(args)
    threads = bench_threads(args.device, [int(c) for c in args.api_server_counts.split(",")])
    if threads is not None:  # inherited by every child (spawn): the offline engine and the server's engine alike
        os.environ["OMP_NUM_THREADS"] = str(threads)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serving_ckpt_") as ckpt:
        proc, _ = run_child(_build, dims, args.device, ckpt)
        proc.join()
        assert proc.exitcode == 0, "building the checkpoint failed"
        warm = warm_load(ckpt, args)
        saturation = [prompts_from(ckpt, args.num_requests, args.input_len, seed=7 + 10 * r)
                      for r in range(args.repeats)]
        warm_saturation = [p.text for p in prompts_from(ckpt, args.num_requests, args.input_len, seed=8)]
        proc, queue = run_child(_offline, ckpt, kw, warm, warm_saturation,
                                [[p.text for p in ps] for ps in saturation], args.output_len, with_queue=True)
        offline = queue.get(timeout=900)
        proc.join()
        print(f"offline LLM.generate: {offline['output_tok_s']:.0f} output tok/s, the median of "
              f"{[round(x) for x in offline['repeats_output_tok_s']]} ({args.num_requests} requests a pass)",
              flush=True)
        sat_rate = offline["output_tok_s"] / args.output_len
        rates = [round(f * sat_rate, 2) for f in map(float, args.rate_fractions.split(","))] + [float("inf")]
        servers = [(loop, count) for loop in args.engine_loops.split(",")
                   for count in (map(int, args.api_server_counts.split(",")) if loop == "process" else [1])]
        by_loop, other_clients = {}, {}
        for i, (loop, count) in enumerate(servers):
            loop_rates = rates if i == 0 else rates[-1:]
            levels = serve_and_measure(ckpt, kw, args, loop, count, loop_rates,
                                       warm + [(text, args.output_len) for text in warm_saturation], saturation)
            by_loop[server_label(loop, count)] = [summary_row(r, lv) for r, lv in zip(loop_rates, levels)]
            for lv in levels[len(loop_rates):]:  # the saturation level with the other --client-procs values
                other_clients[f"{server_label(loop, count)}, {lv.client_procs} client procs"] = summary_row(
                    float("inf"), lv)
            if i > 0:
                print(f"  {server_label(loop, count)}, rate inf: "
                      f"{by_loop[server_label(loop, count)][-1]['output_tok_s']:.0f} tok/s", flush=True)
    loops = list(by_loop)
    rows = by_loop[loops[0]]
    sat = rows[-1]
    ratio = sat["output_tok_s"] / offline["output_tok_s"]
    roofline = decode_roofline_tok_s(dims, args.max_num_seqs, args.input_len + args.output_len // 2,
                                     offline["copy_bytes_per_s"])
    import servebench

    result = dict(
        benchmark="serving", device=offline["device"], torch=offline["torch"], servebench=servebench.__version__,
        model=dict(family="qwen3_moe", **{k: v for k, v in dims.items() if k != "rope_parameters"}),
        load=dict(num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
                  max_num_seqs=args.max_num_seqs, endpoint="/v1/completions (streamed)", ignore_eos=True,
                  saturation_client_procs=args.client_procs[0]),
        slo=dict(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms), offline=offline, rates=rows,
        server_over_offline_at_saturation=ratio, target=0.9, meets_target=ratio >= 0.9,
        decode_roofline_tok_s=roofline, torch_threads=threads, uvicorn_extras=_uvicorn_extras(),
        gil_switch_interval_s=args.gil_switch_interval_s, server=loops[0],
        saturation_by_server={loop: dict(row, over_offline=row["output_tok_s"] / offline["output_tok_s"])
                              for loop, row in [(k, v[-1]) for k, v in by_loop.items()] + list(other_clients.items())},
        wall_s=time.perf_counter() - t_start)
    print(f"\nserving, {result['device']}, qwen3_moe x{dims['num_hidden_layers']} layers, {args.num_requests} "
          f"requests x ({args.input_len} in, {args.output_len} out), max_num_seqs={args.max_num_seqs}; "
          f"goodput SLO: TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print(f"{'rate req/s':>10} {'ok/sent':>8} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
          f"{'out tok/s':>10} {'goodput':>8} {'client lag p99 ms':>18}")
    for r in rows:
        lag = r["client_lag_p99_ms"]
        print(f"{r['rate']:>10g} {r['completed']:>4}/{r['sent']:<3} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>8.1f} "
              f"{r['tpot_p50_ms']:>9.2f} {r['tpot_p99_ms']:>7.2f} {r['output_tok_s']:>10.0f} "
              f"{r['goodput_req_s']:>8.2f} {'-' if lag is None else f'{lag:.1f}':>18}")
    for loop, r in result["saturation_by_server"].items():
        print(f"{loop}: at saturation {r['output_tok_s']:.0f} tok/s = {r['over_offline']:.1%} of offline "
              f"(median of {[round(x) for x in r['repeats_output_tok_s']]})")
    print(f"offline LLM.generate {offline['output_tok_s']:.0f} tok/s; server ({loops[0]}) at saturation "
          f"{sat['output_tok_s']:.0f} tok/s = {ratio:.1%} of offline (target >= 90%); "
          f"{_roofline_text(roofline, offline, args.max_num_seqs)}; "
          f"torch threads {'default' if threads is None else threads} both sides; wall {result['wall_s']:.0f} s")
    write_result(result, f"serving_{_label(result['device'])}{'_tiny' if tiny else ''}.json", args.out)


def _roofline_text(roofline: Optional[float], offline: dict, batch: int) -> str:
    if roofline is None:
        return "no decode roofline (no GPU)"
    return (f"decode roofline at batch {batch} ({offline['device']}, {offline['copy_bytes_per_s'] / 1e12:.2f} TB/s "
            f"measured) {roofline:.0f} tok/s")


def server_label(engine_loop: str, api_servers: int) -> str:
    return f"engine_loop={engine_loop}" + (f", {api_servers} API servers" if api_servers > 1 else "")


def serve_and_measure(ckpt: str, kw: dict, args, engine_loop: str, api_servers: int, rates: list, warm: list,
                      saturation) -> list:
    """A server (`serve()` in a child process) warmed up as the offline engine, then servebench at each rate; SIGTERM
    after (the server drains and exits)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, _ = run_child(_server, ckpt, kw, port, args.num_requests + 64, args.gil_switch_interval_s, engine_loop,
                          api_servers)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        asyncio.run(warm_server(f"{url}/v1", warm))
        return asyncio.run(sweep(f"{url}/v1", ckpt, args, rates, saturation))
    finally:
        server.terminate()
        server.join(60)


def _label(device_name: str) -> str:
    return "cpu" if device_name == "cpu" else device_name.replace("NVIDIA ", "").replace(" ", "_").lower()


def _serve_default(name: str):
    from moe_infer.server.config import ServeConfig

    return getattr(ServeConfig(), name)


def _uvicorn_extras() -> dict:
    import importlib.util

    return {m: importlib.util.find_spec(m) is not None for m in ("uvloop", "httptools")}


if __name__ == "__main__":
    main()
