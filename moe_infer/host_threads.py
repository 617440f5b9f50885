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

libgomp reads the variable once, when torch loads it, so an engine cannot change it in its own
process. Where the host computes misses on a GPU engine and the user chose no policy, it is set
before torch loads: by the main job's launcher (`import moe_infer` does not load torch; the
launcher composes its configuration first) and for the processes the engine starts (the server's
engine core). An engine started otherwise (`LLM(...)` in a process that has loaded torch) with
threads that sleep says so once at start-up. Spinning threads hold their cores (a server's engine core
then leaves one core to each API server process). Only the `cpu` store: the `nvme` store's reader
threads need cores of their own, and spinning next to them is unmeasured.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Dict, Iterator, Mapping, Optional

POLICY_VAR = "OMP_WAIT_POLICY"


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


def wanted_env(offload_cfg, device_type: str, environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """What the environment of a process about to load torch for this engine gains: ACTIVE where the host
    computes misses and the user set no policy (a policy the user set is kept)."""
    if host_computes_misses(offload_cfg, device_type) and POLICY_VAR not in environ:
        return {POLICY_VAR: "ACTIVE"}
    return {}


@contextmanager
def spawn_env(offload_cfg, device_type: str) -> Iterator[Dict[str, str]]:
    """os.environ with wanted_env(...) added while a child process starts (a spawned child copies it then);
    restored after, so the parent and its later children keep their own."""
    added = wanted_env(offload_cfg, device_type)
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
            f"here ({describe(environ)}); start the process with {POLICY_VAR}=ACTIVE to keep them awake (libgomp reads "
            "it when torch loads, so the engine cannot set it in this process; docs/offload.md, 'Host threads')")


def describe(environ: Mapping[str, str] = os.environ) -> str:
    return f"{POLICY_VAR}={environ.get(POLICY_VAR, 'unset')}"
