"""Trial: does the host's SwiGLU expert (the offload CPU path) run faster on huge pages, and does its time drift?

On the H200 host the start-up figure of one Mixtral expert at one row read 6.4-7.2 ms, and the same call on
the engine's own host tier after a run 3.7-6.8 ms. This allocates one expert as the offload host tier does
(`HostRegion`: a plain host tensor, page-locked with cudaHostRegister), once as it is and once with
madvise(MADV_HUGEPAGE) before the first touch, and times `host_expert_ms` (best of 8 after 0.25 s of the
same work) every 2 s for 20 s on each, with the pages' state from /proc/self/smaps_rollup. Prints and writes JSON.

    python benchmarks/trials/host_expert_pages.py [--out PATH] [--seconds 20]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from offload_parts import host_expert_ms  # noqa: E402

MADV_HUGEPAGE = 14


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as err:
        return f"unreadable: {err}"


def anon_huge_kb() -> int:
    for line in _read("/proc/self/smaps_rollup").splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def expert_region(nbytes: int, huge: bool):
    raw = torch.empty(nbytes + (2 << 20), dtype=torch.uint8)
    start = (-raw.data_ptr()) % (2 << 20)
    data = raw[start:start + nbytes]
    advised = None
    if huge:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        advised = libc.madvise(ctypes.c_void_p(data.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    if torch.cuda.is_available():
        err = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), nbytes, 0)
        assert int(err[0] if isinstance(err, tuple) else err) == 0, err
    return raw, data, advised


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="host_expert_pages.json")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--D", type=int, default=4096)
    ap.add_argument("--F", type=int, default=14336)
    args = ap.parse_args()
    D, F = args.D, args.F
    info = {"thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "torch_threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
            "wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpu": platform.processor(),
            "lscpu": [ln for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                      if ln.split(":")[0].strip() in ("Model name", "Socket(s)", "NUMA node(s)", "L3 cache",
                                                       "Thread(s) per core", "CPU(s)")]}
    print(json.dumps(info, indent=1), flush=True)
    runs = {}
    for huge in (False, True, False):
        name = ("huge" if huge else "plain") + ("" if (("huge" if huge else "plain") not in runs) else "_again")
        before = anon_huge_kb()
        raw, data, advised = expert_region(3 * D * F * 2, huge)
        host = data.view(torch.bfloat16)
        host.normal_()
        w13, w2 = host[:2 * F * D].view(2 * F, D), host[2 * F * D:].view(D, F)
        huge_mb = (anon_huge_kb() - before) / 1024
        series, t_end = [], time.perf_counter() + args.seconds
        while True:
            series.append(round(host_expert_ms(w13, w2, 1), 2))
            if time.perf_counter() > t_end:
                break
            time.sleep(2.0)
        rows8 = round(host_expert_ms(w13, w2, 8), 2)
        runs[name] = {"madvise_rc": advised, "anon_huge_mb_gained": round(huge_mb, 1), "ms_1row_every_2s": series,
                      "ms_8rows": rows8}
        print(name, runs[name], flush=True)
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
        del raw, data, host, w13, w2
    with open(args.out, "w") as f:
        json.dump({"info": info, "runs": runs, "expert": {"D": D, "F": F, "dtype": "bf16"}}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
