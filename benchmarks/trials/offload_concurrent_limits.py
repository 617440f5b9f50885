"""Trial: the link and the host cores on whole missed experts at the same time: what rate does each keep?

benchmarks/offload.py's bound for a step adds the link's rate and the host cores' rate, each measured
alone. This trial measures them alone and together on Mixtral-shaped experts (D=4096, F=14336, bf16,
352 MB each) in pinned host memory, as the engine's misses use them:
  link      N whole experts copied host -> device back to back on a side stream (CUDA events)
  cpu(r)    N other experts' SwiGLU computed on the host cores, r rows each, one after another
  both(r)   the N copies queued, then the N host experts computed while they run
and the same with the host on fewer threads, plus a plain host memory copy (1 GB) alone and under the
copies, as a probe of the host memory's bandwidth. Prints the host's NUMA layout first.
"""
import glob
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

D, FF, N = 4096, 14336, 6
GB = 1e9


def swiglu(x, w13, w2):
    h = x @ w13.t()
    return (F.silu(h[:, :FF]) * h[:, FF:]) @ w2.t()


def main():
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} host threads, {os.cpu_count()} cpus", flush=True)
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        print("\n".join(ln for ln in lines if any(k in ln for k in ("Model name", "NUMA", "Socket", "Thread", "L3"))))
    except OSError:
        pass
    for node in sorted(glob.glob("/sys/devices/system/node/node*/meminfo")):
        print(open(node).readline().strip())
    nbytes = 3 * D * FF * 2
    w13 = [torch.randn(2 * FF, D, dtype=torch.bfloat16).pin_memory() for _ in range(2 * N)]
    w2 = [torch.randn(D, FF, dtype=torch.bfloat16).pin_memory() for _ in range(2 * N)]
    d13, d2 = torch.empty_like(w13[0], device=dev), torch.empty_like(w2[0], device=dev)
    side = torch.cuda.Stream()

    def queue_copies():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            for i in range(N):
                d13.copy_(w13[i], non_blocking=True)
                d2.copy_(w2[i], non_blocking=True)
            end.record()
        return start, end

    def cpu_experts(rows):
        x = torch.randn(rows, D, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        for i in range(N, 2 * N):
            swiglu(x, w13[i], w2[i])
        return (time.perf_counter() - t0) * 1e3 / N

    def link_alone():
        s, e = queue_copies()
        e.synchronize()
        return s.elapsed_time(e) / N

    def both(rows):
        s, e = queue_copies()
        cpu = cpu_experts(rows)
        e.synchronize()
        return s.elapsed_time(e) / N, cpu

    def med(fn, n=3):
        fn()
        return statistics.median(fn() for _ in range(n))

    link = med(link_alone)
    print(f"\nlink alone: {link:.2f} ms per expert ({nbytes / link / 1e6:.1f} GB/s)", flush=True)
    print(f"{'threads':>7} {'rows':>4} | {'cpu alone':>9} {'GB/s':>5} | {'link both':>9} {'GB/s':>5} {'cpu both':>8} "
          f"{'GB/s':>5} | {'sum alone':>9} {'sum both':>8}  (ms per expert; GB/s of expert bytes)")
    threads0 = torch.get_num_threads()
    for threads in sorted({threads0, max(1, threads0 // 2), max(1, threads0 * 3 // 4)}, reverse=True):
        torch.set_num_threads(threads)
        for rows in (1, 4, 16):
            cpu = med(lambda: cpu_experts(rows))
            lb, cb = both(rows)
            lb2, cb2 = both(rows)
            lb, cb = (lb + lb2) / 2, (cb + cb2) / 2
            a = nbytes / link / 1e6 + nbytes / cpu / 1e6
            b = nbytes / lb / 1e6 + nbytes / cb / 1e6
            print(f"{threads:7d} {rows:4d} | {cpu:9.2f} {nbytes / cpu / 1e6:5.1f} | {lb:9.2f} {nbytes / lb / 1e6:5.1f} "
                  f"{cb:8.2f} {nbytes / cb / 1e6:5.1f} | {a:9.1f} {b:8.1f}", flush=True)
    torch.set_num_threads(threads0)
    src = torch.empty(int(GB) // 2, dtype=torch.int16).fill_(1)
    dst = torch.empty_like(src)

    def memcpy():
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    alone = med(memcpy)
    s, e = queue_copies()
    under = memcpy()
    e.synchronize()
    print(f"\nhost memcpy of 1 GB ({threads0} threads): alone {2 / alone:.1f} GB/s moved (read + write), under the "
          f"link's copies {2 / under:.1f} GB/s; the link then {nbytes / (s.elapsed_time(e) / N) / 1e6:.1f} GB/s",
          flush=True)

    # a small copy on the compute stream (a step's tables, the host experts' rows back) while an expert's
    # copy runs on the side stream: does it wait for the big one (one copy engine per direction)?
    small = torch.randn(16, D, dtype=torch.bfloat16).pin_memory()
    small_d = torch.empty_like(small, device=dev)

    def small_copy_ms(pieces):
        torch.cuda.synchronize()
        if pieces:
            with torch.cuda.stream(side):
                for i in range(N):
                    for a, b in zip(d13.chunk(pieces), w13[i].chunk(pieces)):
                        a.copy_(b, non_blocking=True)
            time.sleep(0.002)  # the big copies are running
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        small_d.copy_(small, non_blocking=True)
        s1.record()
        s1.synchronize()
        ms = s0.elapsed_time(s1)
        torch.cuda.synchronize()
        return ms

    print(f"\nsmall H2D ({small.numel() * 2 / 1e3:.0f} kB) on the compute stream: alone "
          f"{statistics.median(small_copy_ms(0) for _ in range(5)):.3f} ms; under expert copies (whole) "
          f"{statistics.median(small_copy_ms(1) for _ in range(5)):.3f} ms; under copies in 16 pieces "
          f"{statistics.median(small_copy_ms(16) for _ in range(5)):.3f} ms", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    main()
