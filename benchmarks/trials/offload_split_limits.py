"""Trial: can the link and the host cores share one missed expert (split along F), and at what rate?

One Mixtral-shaped expert (D=4096, F=14336, bf16) in pinned host memory. Times, each the median of
a few runs:
  link      the whole expert copied host -> device (side stream)
  cpu       the whole SwiGLU expert on the host cores, 1 row
  cpu13(c)  only gate/up rows [0:c] on the host (x @ w1[:c].T, x @ w3[:c].T, silu * up), 1 row
  both(c)   the host computes gate/up rows [0:c] while the link copies w2 and gate/up rows [c:F]
            (two contiguous host ranges) at the same time: the split a miss would take
Prints each split's wall time against the model max(link part, cpu part) with the parts timed
alone: the gap is what running both at once costs (host memory bandwidth shared by the DMA
engine and the cores).
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

D, FF = 4096, 14336


def med(fn, n=7):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} host threads, {os.cpu_count()} cpus", flush=True)
    w13 = torch.randn(2 * FF, D, dtype=torch.bfloat16).pin_memory()
    w2 = torch.randn(D, FF, dtype=torch.bfloat16).pin_memory()
    d13 = torch.empty_like(w13, device=dev)
    d2 = torch.empty_like(w2, device=dev)
    side = torch.cuda.Stream()
    x = torch.randn(1, D, dtype=torch.bfloat16)

    def copy(c=0):
        with torch.cuda.stream(side):
            d2.copy_(w2, non_blocking=True)
            if c < FF:
                d13[c:FF].copy_(w13[c:FF], non_blocking=True)
                d13[FF + c:].copy_(w13[FF + c:], non_blocking=True)
        return side

    def cpu_full():
        h = x @ w13.t()
        (F.silu(h[:, :FF]) * h[:, FF:]) @ w2.t()

    def cpu13(c):
        g = x @ w13[:c].t()
        u = x @ w13[FF:FF + c].t()
        return F.silu(g) * u

    link = med(lambda: copy().synchronize())
    full = med(cpu_full)
    print(f"link whole expert {link:.2f} ms ({3 * D * FF * 2 / link / 1e6:.1f} GB/s); cpu whole expert {full:.2f} ms",
          flush=True)
    print(f"{'c/F':>5} {'link part':>9} {'cpu13 part':>10} {'model max':>9} {'both':>7} {'both/whole-link':>15}")
    for frac in (0.25, 0.5, 0.625, 0.75, 0.875, 1.0):
        c = int(FF * frac) // 128 * 128
        lp = med(lambda: copy(c).synchronize())
        cp = med(lambda: cpu13(c))

        def both():
            s = copy(c)
            cpu13(c)
            s.synchronize()

        b = med(both)
        print(f"{frac:5.3f} {lp:9.2f} {cp:10.2f} {max(lp, cp):9.2f} {b:7.2f} {b / link:15.2f}", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    main()
