"""Run a tests/dist worker under torchrun (gloo on CPU) and return (returncode, stderr + stdout)."""
from __future__ import annotations

import os
import signal
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
    rc, stdout, stderr = run_tree(cmd, timeout, cwd=ROOT, env=env)
    if rc == 124:
        stdout += f"\ntorchrun timed out after {timeout:.0f} s"
    return rc, stderr + stdout  # the workers' summaries (stdout) last


def run_tree(cmd: list, timeout: float, **popen_kw) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of cmd. Past timeout every process it started is killed, returncode 124: torchrun's
    ranks run in sessions of their own, so its process group is not enough, and a rank left running holds its GPU,
    its ports and the pipes (communicate would wait for it)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kw)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        for pid in [proc.pid] + descendants(proc.pid):  # found before any is killed (orphans lose their parent)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stdout, stderr = proc.communicate()
        return 124, stdout, stderr


def descendants(pid: int) -> list[int]:
    """Every process below pid (Linux: the parent ids in /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found
