"""Triton kernels (raw @triton.jit code in one module, launch wrappers in another) with PyTorch references.

Specialization: Triton compiles a kernel once per distinct key: its constexprs and, for every other int
and pointer argument, whether the int is 1 / divisible by 16 and whether the address is 16-byte aligned.
Arguments that follow the step's size (token, row, tile, slot counts; workspace strides; slices of the
step's flat input buffer) are listed in the kernel's `do_not_specialize`, so a step of a new size reuses
a compiled kernel; constexprs the wrappers derive from sizes follow powers of two or the tuned configs,
and the engine compiles all of them at start-up (moe_infer/engine/warmup.py). Arguments fixed by the
model (hidden sizes, head counts, weight strides) stay specialized. Exception: the expert GEMMs
(gate_up_kernel, down_kernel) keep their row and tile counts specialized, as they measured up to 1.14x
slower without (H100, Mixtral shape, T=2048, benchmarks/trials/specialize_ab.py); the warm-up compiles
each of their size variants (`fused_moe.launch_variant`).
"""


def jit_kernels() -> list:
    """Every @triton.jit object of this package's modules (device helpers included), imported on call."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface

    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [obj for obj in vars(module).values() if isinstance(obj, KernelInterface) and obj not in found]
    return found
