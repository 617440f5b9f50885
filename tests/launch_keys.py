"""What Triton compiles, seen without compiling: the project's kernels' launches recorded instead of run.

Triton keeps one compiled variant of a kernel per specialization key (Triton's rule, independent of the
code under test): every constexpr's value; for each other argument its type and, unless the kernel lists it
in `do_not_specialize`, whether an int is 1 and divisible by 16 and whether a tensor's address is 16-byte
aligned; and the launch options (num_warps, num_stages, ...). `LaunchKeys` replaces `run` of every
@triton.jit kernel of moe_infer.kernels by a recorder of that key (the launch does not happen: outputs
stay uninitialised, which the host never reads), so a CPU test sees which steps would compile a new variant.

`count_compiles` is the GPU side: Triton's own post-compile hook counts real compiles (and loads from its
disk cache) of a process.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Dict, List

import torch

from moe_infer.kernels import jit_kernels


def no_specialize(kernel) -> set:
    names = getattr(kernel, "do_not_specialize", None)  # JITFunction
    if names is None:  # the interpreter's function keeps its decorator arguments
        names = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    return set(names or ())


def _arg_key(value, specialize: bool) -> tuple:
    if isinstance(value, bool):
        return ("u1",)
    if isinstance(value, int):
        kind = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        return (kind, value == 1, value % 16 == 0) if specialize else (kind,)
    if isinstance(value, float):
        return ("fp32",)
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.data_ptr() % 16 == 0) if specialize else (str(value.dtype),)
    if hasattr(value, "block_shape"):  # a TMA tensor descriptor
        return ("desc", str(value.base.dtype), tuple(value.block_shape))
    return (type(value).__name__, repr(value))


def launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """(kernel name, ((arg, its key), ...), launch options): equal keys share one compiled variant."""
    sig = inspect.signature(kernel.fn)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    dns = no_specialize(kernel)
    fields = []
    for i, (name, param) in enumerate(sig.parameters.items()):
        value = bound.arguments[name]
        if "constexpr" in str(param.annotation):
            fields.append((name, ("constexpr", repr(value))))
        else:
            fields.append((name, _arg_key(value, name not in dns and i not in dns)))
    options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in sig.parameters))
    return kernel.fn.__name__, tuple(fields), options


class LaunchKeys:
    """Records the launch keys of the project's kernels (monkeypatch: undone at the test's end)."""

    def __init__(self, monkeypatch) -> None:
        self.keys: Dict[tuple, str] = {}  # key -> where it was first seen
        self.where = ""
        for kernel in jit_kernels():
            monkeypatch.setattr(kernel, "run", self._recorder(kernel))

    def _recorder(self, kernel):
        def run(*args, grid, warmup, **kwargs):
            self.keys.setdefault(launch_key(kernel, args, kwargs), self.where)
        return run

    def new_since(self, before: Dict[tuple, str]) -> List[str]:
        """Readable lines for each key not in `before`: where it was seen, and its fields that differ from
        the closest key of the same kernel in `before`."""
        lines = []
        for key, where in self.keys.items():
            if key in before:
                continue
            name, fields, options = key
            same = [k for k in before if k[0] == name]
            if not same:
                lines.append(f"{where}: {name} never launched before")
                continue
            best = min(same, key=lambda k: sum(a != b for a, b in zip(k[1], fields)) + (k[2] != options))
            diff = [f"{n}={v} (had {w})" for (n, v), (_, w) in zip(fields, best[1]) if v != w]
            if best[2] != options:
                diff.append(f"options {options} (had {best[2]})")
            lines.append(f"{where}: {name}: " + ", ".join(diff))
        return lines


@contextlib.contextmanager
def count_compiles(where: Callable[[], str] = lambda: ""):
    """Yields a list that receives one line per Triton JIT compile in the block (triton.knobs' post-compile
    hook, Triton >= 3.4): where() at the time, and the kernel with its specialization."""
    from triton import knobs

    compiled: List[str] = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        compiled.append(f"{where()}: {kwargs.get('repr') or kwargs.get('key')}")
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def shapes_of(lines: List[str], limit: int = 12) -> str:
    return "\n".join(lines[:limit]) + (f"\n... and {len(lines) - limit} more" if len(lines) > limit else "")

