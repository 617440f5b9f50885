"""Trial (measurement notes, not a benchmark): host time of one eager call of a decode-sized linear layer,
`F.linear` (cuBLAS) against `skinny_gemm` (through Triton's launcher), and the wall time of the same calls
back to back. Eager paths (offload steps' routers, capacity policies, meshes) pay the host time per call,
which is why `layers.linear` takes the kernel only in forwards captured as CUDA graphs.

    python benchmarks/trials/skinny_gemm_host.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def host_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e6
    return host, wall


def main():
    from moe_infer.kernels.skinny_gemm import skinny_gemm
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; us per call: host (launch returns), wall (n calls, then a sync)")
    for name, N, K in (("qwen3 router", 128, 2048), ("qwen3 o", 2048, 4096), ("mixtral router", 8, 4096)):
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        for label, fn in (("F.linear", lambda: F.linear(x, w)), ("skinny", lambda: skinny_gemm(x, w))):
            h, wall = host_us(fn)
            print(f"{name:15s} {label:9s} host {h:6.1f}  wall {wall:6.1f}", flush=True)


if __name__ == "__main__":
    main()
