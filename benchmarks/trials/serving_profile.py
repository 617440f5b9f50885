"""Trial (measurement notes): where the server's time goes at saturation. serving.py's model, server and
saturation load (N streamed requests at once, measured by servebench), run twice against one warmed server:
once plain (output tok/s), once under py-spy (sampling the server's HTTP process, its engine core process and
this process, the load generator). Prints each process's CPU use over the plain run (from /proc: a process at
100 % of one core is the bottleneck) and, per process, the functions py-spy found most (self and inclusive,
idle samples included, so waiting on the GPU or a socket shows as such).

    python benchmarks/trials/serving_profile.py [--out DIR] [--api-servers N]    # H100: ~3 min; needs py-spy
"""
import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime + stime


def children(pid: int) -> list:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
        except OSError:
            pass
    return out


def listening_inodes(port: int) -> set:
    """Socket inodes listening on TCP `port` (from /proc/net/tcp and tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                        inodes.add(cols[9])
        except OSError:
            pass
    return inodes


def listens(pid: int, inodes: set) -> bool:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def server_processes(server_pid: int, api_servers: int, port: int) -> dict:
    """name -> pid: the HTTP process(es), those listening on the port, and the engine core, the child that does
    not (multiprocessing's resource tracker left out). With several API servers the launcher only supervises."""
    inodes, kids = listening_inodes(port), []
    for pid in children(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                kids.append(pid)
    core = [p for p in kids if not listens(p, inodes)]
    https = [p for p in kids if listens(p, inodes)]
    if api_servers == 1:
        return {"http": server_pid, **{f"core{i}": p for i, p in enumerate(core)}}
    return {"launcher": server_pid, **{f"http{i}": p for i, p in enumerate(https)},
            **{f"core{i}": p for i, p in enumerate(core)}}


def summarize(raw_path: str, names: dict, top: int) -> dict:
    """py-spy raw (collapsed) stacks -> per process: samples, top self and inclusive functions."""
    per = collections.defaultdict(lambda: [0, collections.Counter(), collections.Counter()])
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = re.sub(r'process (\d+):"[^"]*"', r"process \1", stack).split(";")  # command lines hold ';'
            pids = [int(fr.split()[1]) for fr in frames if fr.startswith("process ")]  # a child's after its parent's
            proc = names.get(pids[-1], str(pids[-1])) if pids else names.get("self", "?")
            funcs = [re.sub(r":\d+\)$", ")", fr) for fr in frames if not fr.startswith(("process ", "thread "))]
            if not funcs:
                continue
            n = int(count)
            entry = per[proc]
            entry[0] += n
            entry[1][funcs[-1]] += n
            for fn in set(funcs):
                entry[2][fn] += n
    return {proc: dict(samples=s, self=[(fn, c / s) for fn, c in selfs.most_common(top)],
                       inclusive=[(fn, c / s) for fn, c in incl.most_common(top)])
            for proc, (s, selfs, incl) in per.items()}


def main():
    import serving
    from e2e_generate import REAL, TINY

    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--offline", action="store_true", help="also time LLM.generate on the plain level's load")
    ap.add_argument("--api-servers", type=int, default=1, help="serve.api_server_count")
    ap.add_argument("--tiny", action="store_true", help="tiny dims on CPU, 32 requests x (32 in, 16 out): a smoke run")
    args = ap.parse_args()
    args.device, args.slo_ttft_ms, args.slo_tpot_ms = "cpu" if args.tiny else "cuda", 1000.0, 50.0
    args.client_procs = [1]  # one load generator (it is profiled too); sweep takes a list (--client-procs 1,4)
    if args.tiny:
        args.num_requests, args.input_len, args.output_len, args.max_num_seqs = 32, 32, 16, 16
    pyspy = shutil.which("py-spy")
    kw = serving.engine_kwargs(args)
    with tempfile.TemporaryDirectory(prefix="serving_profile_") as ckpt:
        dims = dict(TINY if args.tiny else REAL, vocab_size=6144)
        proc, _ = serving.run_child(serving._build, dims, args.device, ckpt)
        proc.join()
        warm = serving.warm_load(ckpt, args)
        loads = [serving.prompts_from(ckpt, args.num_requests, args.input_len, seed=s) for s in (7, 9)]
        warm += [(p.text, args.output_len) for p in serving.prompts_from(ckpt, args.num_requests, args.input_len, 8)]
        offline = None
        if args.offline:  # serving.py's offline measurement of this load (its own process, first)
            proc, queue = serving.run_child(serving._offline, ckpt, kw, serving.warm_load(ckpt, args),
                                            [p.text for p in loads[1]], [[p.text for p in loads[0]]], args.output_len,
                                            with_queue=True)
            offline = queue.get(timeout=900)
            proc.join()
            print(f"offline: {offline['output_tok_s']:.0f} tok/s ({offline['elapsed_s']:.2f} s)", flush=True)
        port = 18000 + os.getpid() % 1000
        server, _ = serving.run_child(serving._server, ckpt, kw, port, args.num_requests + 64, 0.005, "process",
                                      args.api_servers)
        url = f"http://127.0.0.1:{port}"
        try:
            serving.wait_healthy(url, server)
            asyncio.run(serving.warm_server(f"{url}/v1", warm))
            pids = {**server_processes(server.pid, args.api_servers, port), "client": os.getpid()}
            before = {k: cpu_s(p) for k, p in pids.items()}
            start = time.perf_counter()
            level = asyncio.run(serving.sweep(f"{url}/v1", ckpt, args, [float("inf")], [loads[0]]))[0]
            wall = time.perf_counter() - start
            used = {k: cpu_s(p) - before[k] for k, p in pids.items()}
            print(f"plain: {level.summary.output_throughput:.0f} tok/s, wall {wall:.2f} s", flush=True)
            print(f"  sends end at {max(r.start for r in level.requests):.3f} s", flush=True)
            for k, v in used.items():
                print(f"  {k:>7} pid {pids[k]}: {v:.2f} CPU s = {v / wall:.0%} of one core", flush=True)
            profile = {}
            if pyspy is None:
                print("py-spy not found: no profile")
            else:
                raw = os.path.join(args.out, "serving_profile_raw.txt")
                raw_client = os.path.join(args.out, "serving_profile_client_raw.txt")
                spies = [subprocess.Popen([pyspy, "record", "--pid", str(server.pid), "--subprocesses", "--idle",
                                           "--rate", "200", "--format", "raw", "--nonblocking", "--output", raw,
                                           "--duration", str(int(wall * 1.5) + 3)]),
                         subprocess.Popen([pyspy, "record", "--pid", str(os.getpid()), "--idle", "--rate", "200",
                                           "--format", "raw", "--nonblocking", "--output", raw_client,
                                           "--duration", str(int(wall * 1.5) + 3)])]
                time.sleep(1.5)
                level2 = asyncio.run(serving.sweep(f"{url}/v1", ckpt, args, [float("inf")], [loads[1]]))[0]
                print(f"under py-spy: {level2.summary.output_throughput:.0f} tok/s", flush=True)
                for s in spies:
                    s.wait(120)
                names = {p: k for k, p in pids.items()} | {"self": "client"}  # py-spy names no process of one pid
                for path in (raw, raw_client):
                    if os.path.exists(path):
                        profile.update(summarize(path, names, args.top))
                for proc_name, prof in profile.items():
                    print(f"\n== {proc_name}: {prof['samples']} samples; self")
                    for fn, share in prof["self"]:
                        print(f"  {share:6.1%}  {fn}")
                    print(f"-- {proc_name}: inclusive")
                    for fn, share in prof["inclusive"]:
                        print(f"  {share:6.1%}  {fn}")
        finally:
            server.terminate()
            server.join(60)
    with open(os.path.join(args.out, "serving_profile.json"), "w") as f:
        json.dump(dict(api_servers=args.api_servers, tok_s=level.summary.output_throughput, wall_s=wall, cpu_s=used, offline=offline,
                       profile=profile), f, indent=1)


if __name__ == "__main__":
    main()
