"""Triton kernels compiled in parallel, in worker processes, into Triton's disk cache.

Triton compiles a kernel variant the first time a launch needs it, in the launching thread: a warm-up that runs
forwards compiles its ~200 variants one after the other (on an H200 ~0.4 s each, most of a cold start). Here the
compiles are found first and done by a pool of processes, then the warm-up runs and finds them all on disk:

1. `dry_launches(on_missing)`: while it is open every Triton launch only binds its arguments, the variant it would
   run is looked up (memory, then Triton's disk cache: loaded where found), and none is launched. A variant that is
   not on disk goes to on_missing as a `KernelSpec` (its module, name and Triton's own specialization data, the
   format of `JITFunction.preload`) instead of being compiled. The caller runs its forwards inside a CUDA graph
   capture that it throws away, so that the torch ops between the skipped kernels execute nothing either.
2. `CompilePool`: worker processes (`python -m moe_infer.kernels.precompile`, started at the first spec) each
   compile the specs sent to them for the parent's GPU target (`compile_spec`, no CUDA needed), and build each
   one's host-side launcher (C, compiled by the system compiler: `build_launcher`), into the disk cache, which
   they share with the parent (TRITON_CACHE_DIR, inherited).
3. The caller's real warm-up then loads every variant from disk (milliseconds each).

ptxas runs as a subprocess either way; the MLIR passes run in the workers' own interpreters (no GIL shared). A
spec a worker cannot compile is only reported: the real warm-up compiles it in the parent, as without the pool.

Where the disk cache lives: Triton's, `TRITON_CACHE_DIR` (default ~/.triton/cache); it persists across runs, and a
second start on the same machine loads every kernel from it (docs/running.md: pointing it at a shared disk).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Callable, Iterator, List, Optional, Tuple

logger = logging.getLogger(__name__)

MAX_WORKERS = 32


@dataclass(frozen=True)
class KernelSpec:
    """One kernel variant to compile: the JIT function's module and qualified name, and Triton's specialization
    data (the JSON `JITFunction.preload` reads: signature, constexprs, attributes, options)."""

    module: str
    qualname: str
    data: str


def default_workers() -> int:
    """Worker processes when not configured: one per CPU core this process may run on but one, at most MAX_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(MAX_WORKERS, cores - 1))


def jit_function(module: str, qualname: str):
    """The JITFunction named module:qualname (through the wrappers of `triton.heuristics` / `autotune`: `.fn`)."""
    from triton.runtime.jit import JITFunction

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    if not isinstance(obj, JITFunction):
        raise TypeError(f"{module}:{qualname} is a {type(obj).__name__}, not a Triton JIT function")
    return obj


def _decode(data: str) -> Tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of specialization data, decoded as `JITFunction.preload` does."""
    import triton.language as tl

    obj = json.loads(data)

    def value(v):
        if tl.dtype.is_dtype(v):
            return tl.dtype(v)
        if isinstance(v, dict) and "constexpr" in v:
            c = v["constexpr"]
            return tl.constexpr(tuple(c) if isinstance(c, list) else c)
        if isinstance(v, dict):
            raise ValueError(f"a constexpr this module cannot rebuild: {v}")
        return tuple(v) if isinstance(v, list) else v

    constexprs = {tuple(k): value(v) for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    return signature, constexprs, attrs, options


def _source(fn, data: str, target):
    """(the ASTSource, its options) of fn's variant for target."""
    from triton.compiler.compiler import ASTSource, make_backend

    signature, constexprs, attrs, options = _decode(data)
    return ASTSource(fn, signature, constexprs, attrs), make_backend(target).parse_options(options).__dict__


def compile_spec(fn, data: str, target):
    """Compile fn's variant for target into Triton's disk cache (no CUDA needed: ptxas runs for target's arch);
    returns (its ASTSource, the CompiledKernel)."""
    from triton.compiler import compile as triton_compile

    src, options = _source(fn, data, target)
    return src, triton_compile(src, target=target, options=options)


def build_launcher(src, kernel) -> None:
    """The host-side launcher of a compiled CUDA kernel: Triton builds one per signature and constants, C compiled by
    the system's compiler at the kernel's first launch, cached on disk by its source; built here, that launch finds
    it (no CUDA call: the launcher links libcuda, found as Triton finds it)."""
    from triton.backends.nvidia.driver import CudaLauncher

    CudaLauncher(src, kernel.metadata)


def is_cached(fn, data: str, target) -> bool:
    """Whether fn's variant is in Triton's disk cache: the lookup `triton.compiler.compile` starts with."""
    from triton.compiler import compiler as tc

    src, options = _source(fn, data, target)
    backend = tc.make_backend(target)
    options = backend.parse_options(dict(options, **src.parse_options()))
    key = tc.get_cache_key(src, backend, options, env_vars=tc.get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    group = tc.get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
    return group.get(name) is not None


def target_dict(target) -> dict:
    return {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size}


def target_of(d: dict):
    from triton.backends.compiler import GPUTarget

    return GPUTarget(d["backend"], d["arch"], d["warp_size"])


@contextlib.contextmanager
def dry_launches(on_missing: Callable[[KernelSpec], None]) -> Iterator[None]:
    """While open: Triton launches launch nothing (`JITFunction.run` as its warmup); a variant on disk is loaded, one
    that is not goes to on_missing (once per variant) and is left uncompiled (one whose data cannot be decoded here
    is compiled in this process). Not thread-safe: it patches Triton's
    launch for the whole process (and restores it)."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    target = None
    here = {}  # (function, key) -> compiled (or loaded) here, else sent to on_missing

    def hook(*, key, fn, compile, **_):
        nonlocal target
        jf = fn.jit_function
        local = here.get((id(jf), str(key)))
        if local is None:
            if target is None:
                from triton.runtime.driver import driver

                target = driver.active.get_current_target()
            data = compile["specialization_data"]
            try:
                local = is_cached(jf, data, target)
            except Exception:  # noqa: BLE001 - a variant this module cannot rebuild: Triton compiles it here
                local = True
            here[(id(jf), str(key))] = local
            if not local:
                on_missing(KernelSpec(jf.fn.__module__, jf.fn.__qualname__, data))
        return None if local else True  # True: Triton skips the compile (and, here, never launches)

    run = JITFunction.run

    def dry_run(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    old_hook = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook, JITFunction.run = hook, dry_run
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook, JITFunction.run = old_hook, run


class CompilePool:
    """Worker processes compiling KernelSpecs into the disk cache; started at the first `submit`, each spec sent to
    the next worker in turn. `finish()` waits for them: (specs compiled, error messages). A worker that cannot start
    or dies only costs its specs (reported; whoever launches them compiles them then)."""

    def __init__(self, num_workers: int, target, python: str = sys.executable) -> None:
        if num_workers <= 0:
            raise ValueError(f"a compile pool needs at least one worker, got {num_workers}")
        self.num_workers, self.target, self.python = num_workers, target, python
        self.procs: List[Tuple[subprocess.Popen, IO[str]]] = []
        self.num_submitted = 0
        self.errors: List[str] = []
        self.launcher_errors: List[str] = []
        self.started: Optional[float] = None

    def _start(self) -> None:
        import moe_infer

        root = os.path.dirname(os.path.dirname(os.path.abspath(moe_infer.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.started = time.perf_counter()
        for _ in range(self.num_workers):
            err = tempfile.TemporaryFile("w+")  # not a pipe: nobody reads it before the end
            proc = subprocess.Popen([self.python, "-m", "moe_infer.kernels.precompile"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env)
            proc.stdin.write(json.dumps(target_dict(self.target)) + "\n")
            self.procs.append((proc, err))

    def submit(self, spec: KernelSpec) -> None:
        if not self.procs and not self.errors:
            try:
                self._start()
            except OSError as err:
                self.errors.append(f"the compile workers did not start: {err}")
        if not self.procs:
            return
        proc = self.procs[self.num_submitted % len(self.procs)][0]
        self.num_submitted += 1
        try:
            proc.stdin.write(json.dumps([spec.module, spec.qualname, spec.data]) + "\n")
            proc.stdin.flush()
        except OSError as err:  # the worker died: its specs compile where they are launched
            self.errors.append(f"a compile worker stopped ({err})")

    def finish(self, timeout: float = 600.0) -> Tuple[int, List[str]]:
        num_compiled = 0
        deadline = time.monotonic() + timeout
        for proc, err in self.procs:
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
                proc.kill()
                proc.wait()
                self.errors.append(f"a compile worker did not finish: {type(exc).__name__}")
                err.close()
                continue
            try:
                report = json.loads(out.strip().splitlines()[-1])
                num_compiled += report["compiled"]
                self.errors.extend(report["errors"])
                self.launcher_errors.extend(report.get("launcher_errors", []))
            except (IndexError, KeyError, ValueError):
                err.seek(0)
                self.errors.append(f"a compile worker failed (exit {proc.returncode}): {err.read().strip()[-500:]}")
            err.close()
        self.procs = []
        return num_compiled, self.errors

    @property
    def seconds(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started


def worker_main(lines=sys.stdin, out=sys.stdout) -> None:
    """A compile worker: the first line is the target, each next one a spec [module, qualname, data], compiled and
    its launcher built; at the end of its input it prints {"compiled": n, "errors": [...], "launcher_errors": [...]}."""
    target = None
    compiled, errors, launcher_errors = 0, [], []
    for line in lines:
        if not line.strip():
            continue
        if target is None:
            target = target_of(json.loads(line))
            continue
        module, qualname, data = json.loads(line)
        try:
            src, kernel = compile_spec(jit_function(module, qualname), data, target)
            compiled += 1
        except Exception as err:  # noqa: BLE001 - reported; the parent compiles it where it launches it
            errors.append(f"{module}:{qualname}: {type(err).__name__}: {str(err)[:300]}")
            continue
        if target.backend == "cuda":
            try:
                build_launcher(src, kernel)
            except Exception as err:  # noqa: BLE001 - reported; the parent builds it at the kernel's first launch
                launcher_errors.append(f"{module}:{qualname}: {type(err).__name__}: {str(err)[:300]}")
    out.write(json.dumps({"compiled": compiled, "errors": errors, "launcher_errors": launcher_errors}) + "\n")
    out.flush()


if __name__ == "__main__":
    worker_main()
