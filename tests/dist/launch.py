"""Run a tests/dist worker under torchrun (gloo on CPU) and return (returncode, stderr + stdout)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_env() -> dict[str, str]:
    """This checkout first on the path, then what the caller's PYTHONPATH had (wheels carried to a device)."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)


def torchrun(nproc: int, worker: str, *args: str, timeout: float = 240) -> tuple[int, str]:
    env = worker_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "tests", "dist", worker), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr + proc.stdout  # the workers' summaries (stdout) last
