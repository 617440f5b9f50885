"""Trial: one Mixtral expert on the host cores, the same expert each call (hot: partly in the host's
last-level cache) against another expert each call (cold: from DRAM, as the engine's misses are),
with the link idle or busy copying other experts (the host memory is shared by the DMA engine and
the cores). Parts: the whole SwiGLU expert, gate/up alone (what a shared miss computes on the host)
and the down projection alone, the latter also as torch.mv and from a transposed copy of w2.

    OMP_WAIT_POLICY=ACTIVE python benchmarks/trials/cpu_expert_cold.py [experts] [repeats]

The start-up cost model (moe_infer/offload/cost.py) times one expert again and again (hot).
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

D, FF = 4096, 14336


def main():
    n_exp = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} host threads, {os.cpu_count()} cpus, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, {n_exp} experts", flush=True)
    g = torch.Generator().manual_seed(0)
    w13 = [torch.randn(2 * FF, D, generator=g).to(torch.bfloat16) for _ in range(n_exp)]
    w2 = [torch.randn(D, FF, generator=g).to(torch.bfloat16) for _ in range(n_exp)]
    w2t = [w.t().contiguous() for w in w2]
    if cuda:
        w13 = [w.pin_memory() for w in w13]
        w2 = [w.pin_memory() for w in w2]
        dev13 = torch.empty_like(w13[0], device="cuda")
        dev2 = torch.empty_like(w2[0], device="cuda")
        side = torch.cuda.Stream()

    def link_busy(on: bool):
        """Queue enough copies of other experts to keep the link busy for the timed calls."""
        if not (cuda and on):
            return
        with torch.cuda.stream(side):
            for i in range(reps * 2):
                dev13.copy_(w13[(i + 3) % n_exp], non_blocking=True)
                dev2.copy_(w2[(i + 3) % n_exp], non_blocking=True)

    parts = {
        "whole": lambda x, e: (F.silu((h := x @ w13[e].t())[:, :FF]) * h[:, FF:]) @ w2[e].t(),
        "gate_up": lambda x, e: F.silu(x @ w13[e][:FF].t()) * (x @ w13[e][FF:].t()),
        "down": lambda x, e: x[:, :1].expand(x.shape[0], FF).contiguous() @ w2[e].t(),
        "down_mv": lambda x, e: torch.mv(w2[e], x[0, :1].expand(FF).contiguous()),
        "down_T": lambda x, e: x[:, :1].expand(x.shape[0], FF).contiguous() @ w2t[e],
    }
    mb = {"whole": 3 * D * FF * 2, "gate_up": 2 * D * FF * 2, "down": D * FF * 2, "down_mv": D * FF * 2,
          "down_T": D * FF * 2}
    print(f"{'part':8s} {'rows':>4s} {'link':>5s} {'hot ms':>8s} {'GB/s':>6s} {'cold ms':>8s} {'GB/s':>6s}")
    for rows in (1, 8):
        x = torch.randn(rows, D, generator=g).to(torch.bfloat16)
        for name, fn in parts.items():
            if name == "down_mv" and rows != 1:
                continue
            for busy in ((False, True) if cuda else (False,)):
                res = []
                for mode in ("hot", "cold"):
                    fn(x, 0)
                    link_busy(busy)
                    ts = []
                    for i in range(reps):
                        e = 0 if mode == "hot" else (i * 5 + 1) % n_exp
                        t0 = time.perf_counter()
                        fn(x, e)
                        ts.append(time.perf_counter() - t0)
                    if cuda:
                        side.synchronize()
                    ms = statistics.median(ts) * 1e3
                    res.append((ms, mb[name] / ms / 1e6))
                print(f"{name:8s} {rows:4d} {'busy' if busy else 'idle':>5s} {res[0][0]:8.2f} {res[0][1]:6.1f} "
                      f"{res[1][0]:8.2f} {res[1][1]:6.1f}", flush=True)


if __name__ == "__main__":
    main()
