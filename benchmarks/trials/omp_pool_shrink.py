"""Trial: does a libgomp pool made smaller keep its extra threads spinning? The CPU seconds used in one idle
second after parallel regions on `first` threads, then on `n` (argv: n first). Under OMP_WAIT_POLICY=ACTIVE
every thread of the pool spins while idle; the main thread sleeps.

    OMP_WAIT_POLICY=ACTIVE python benchmarks/trials/omp_pool_shrink.py 15 16
"""
import os
import resource
import sys
import time

import torch


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    n, first = int(sys.argv[1]), int(sys.argv[2])
    a = torch.randn(1024, 1024)
    torch.set_num_threads(first)
    a @ a
    torch.set_num_threads(n)
    a @ a
    c0 = cpu_seconds()
    time.sleep(1.0)
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}: a pool of {first}, then {n} threads; "
          f"one idle second: {cpu_seconds() - c0:.2f} cpu-s", flush=True)


if __name__ == "__main__":
    main()
