"""The host cores' threads for the offload path's CPU experts: awake between layers, or asleep.

Design. The experts the host computes (`miss_policy` auto, cpu, share) run through torch's intra-op
pool: OpenMP threads (libgomp in the Linux wheels). Between two layers' host experts the main thread
spends milliseconds launching the device's work in Python, and libgomp's workers spin only briefly
after a parallel region (OMP_WAIT_POLICY unset) before they sleep in the kernel; every layer's host
experts then start by waking them. With OMP_WAIT_POLICY=ACTIVE they spin until the next parallel
region. Measured on an H200 host (16 cores, measurement notes in docs/offload.md): one Mixtral expert
at one row after 20 ms of the main thread busy in Python took 5.3-6.4 ms with the policy unset and
3.1 ms with ACTIVE. In `benchmarks/offload.py` (two calls) ACTIVE was ahead in 9 of 10 runs, by
4-36 % (all 32 Mixtral layers at 24 GB: one traced stream 4.29 -> 4.57 tok/s, 16 streams 20.9 ->
24.0), and 8 % behind in one (Qwen3, one stream, no miss sent to the host).

Spinning threads hold their cores. With one in every core they contend with the main thread (Python,
CUDA launches and syncs, the driver's own threads), so the pool that comes with ACTIVE leaves the main
thread a core: OMP_NUM_THREADS = cores - 1, less one core for each API server process of a server.
Measured on the same host, 15 threads against 16, A/B/A in one call (32 Mixtral layers): one stream
5.2/5.8 -> 7.3 tok/s with the model's router and 4.1/4.4 -> 4.7 with traced routing, 16 streams
19.8/20.8 -> 23.4 and 22.4/22.7 -> 23.6; at 16 layers, six processes alternating after a warm-up one,
5-11 % ahead on the means of the same four rows.

libgomp reads both variables once, when torch loads it, so an engine cannot change them in its own
process. Where the host computes misses on a GPU engine and the user chose no policy, they are set
before torch loads (a thread count the user set is kept): by the main job's launcher (`import
moe_infer` does not load torch; the launcher composes its configuration first) and for the processes
the engine starts (the server's engine core). An engine started otherwise (`LLM(...)` in a process
that has loaded torch) with threads that sleep says so once at start-up. Only the `cpu` store: the
`nvme` store's reader threads need cores of their own, and spinning next to them is unmeasured.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Dict, Iterator, Mapping, Optional

POLICY_VAR = "OMP_WAIT_POLICY"
THREADS_VAR = "OMP_NUM_THREADS"


def host_cores() -> int:
    """The cores this process may run on (its affinity mask), as OpenMP counts them for its default pool."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def device_type_of(name: str, cuda_available: bool) -> str:
    """'cuda' or 'cpu' for a model.device setting (auto | cpu | cuda | cuda:N)."""
    if name == "auto":
        return "cuda" if cuda_available else "cpu"
    return "cuda" if name.startswith("cuda") else "cpu"


def host_computes_misses(offload_cfg, device_type: str) -> bool:
    """Whether the host cores compute expert misses beside a GPU (not on a CPU engine, where they compute everything)."""
    return device_type == "cuda" and offload_cfg.store == "cpu" and offload_cfg.miss_policy != "wait"


def spins(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(POLICY_VAR, "").strip().upper() == "ACTIVE"


def cuda_present(environ: Mapping[str, str] = os.environ) -> bool:
    """A guess without torch (for model.device=auto before torch loads) whether this process will see a CUDA
    device: the NVIDIA driver's control node exists and CUDA_VISIBLE_DEVICES does not hide every device."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl")


def wanted_env(offload_cfg, device_type: str, environ: Mapping[str, str] = os.environ,
               reserved_cores: int = 0) -> Dict[str, str]:
    """What the environment of a process about to load torch for this engine gains: ACTIVE where the host
    computes misses and the user set no policy (a policy the user set is kept), and with it a pool of threads
    that leaves one core to the main thread and `reserved_cores` to other processes (a server's API processes),
    unless the user set OMP_NUM_THREADS."""
    if not host_computes_misses(offload_cfg, device_type) or POLICY_VAR in environ:
        return {}
    added = {POLICY_VAR: "ACTIVE"}
    if THREADS_VAR not in environ:
        added[THREADS_VAR] = str(max(1, host_cores() - 1 - reserved_cores))
    return added


@contextmanager
def spawn_env(offload_cfg, device_type: str, reserved_cores: int = 0) -> Iterator[Dict[str, str]]:
    """os.environ with wanted_env(...) added while a child process starts (a spawned child copies it then);
    restored after, so the parent and its later children keep their own."""
    added = wanted_env(offload_cfg, device_type, reserved_cores=reserved_cores)
    os.environ.update(added)
    try:
        yield added
    finally:
        for key in added:
            os.environ.pop(key, None)


def start_up_note(offload_cfg, device_type: str, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """A warning for an engine whose host computes misses with threads that sleep between layers, else None."""
    if not host_computes_misses(offload_cfg, device_type) or spins(environ):
        return None
    return (f"offload: the host computes expert misses with torch's OpenMP threads, which sleep between layers "
            f"here ({describe(environ)}); start the process with {POLICY_VAR}=ACTIVE {THREADS_VAR}="
            f"{max(1, host_cores() - 1)} to keep them awake and a core for the main thread (libgomp reads both when "
            "torch loads, so the engine cannot set them in this process; docs/offload.md, 'Host threads')")


def describe(environ: Mapping[str, str] = os.environ) -> str:
    threads = f" {THREADS_VAR}={environ[THREADS_VAR]}" if THREADS_VAR in environ else ""
    return f"{POLICY_VAR}={environ.get(POLICY_VAR, 'unset')}{threads}"
