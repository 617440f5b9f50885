"""Optional backends that register themselves on import (Triton kernels, all-to-all dispatchers).

`load_plugins()` imports each module once; a module whose optional dependency (triton) is not
installed is skipped, any other import error is raised. The skipped modules are reported in one line,
once: at INFO where a CUDA device is present (its Triton kernels would have run), at DEBUG otherwise (a CPU
install without triton is the expected case, not news).
"""
from __future__ import annotations

import importlib
import logging
from typing import Dict, List

logger = logging.getLogger(__name__)

PLUGIN_MODULES = (
    "moe_infer.kernels.ep_ops",  # EP_ROW_OPS["triton"]: the all-to-all dispatchers' row kernels
    "moe_infer.routing.triton_select",  # ROUTING_BACKENDS["triton"], capacity policies on GPU
    "moe_infer.experts.triton_experts",  # EXPERT_BACKENDS["triton"]
    "moe_infer.layers.attention_triton",  # ATTENTION_BACKENDS["triton"]: paged attention reading K/V in place
    "moe_infer.layers.mla_triton",  # MLA_BACKENDS["triton"]: MLA attention reading the latent cache in place
    "moe_infer.layers.quant_triton",  # FP8_LINEAR_KERNELS["triton"]: W8A8 block-scaled GEMMs of fp8 weights
    "moe_infer.layers.norm_triton",  # RMS_NORM_KERNELS["triton"]: RMSNorm (+ residual add) in one launch
    "moe_infer.routing.load_count_triton",  # LOAD_COUNT_KERNELS["triton"]: a layer's expert-load counts, one launch
    "moe_infer.layers.linear_triton",  # LINEAR_KERNELS["triton"]: decode-sized linear layers (skinny GEMM)
)

_loaded: List[str] = []
_missing: Dict[str, str] = {}  # module -> why it was skipped
_done: List[bool] = []


def load_plugins() -> List[str]:
    if _done:
        return list(_loaded)
    for name in PLUGIN_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name not in ("triton", name) and not (err.name and name.startswith(err.name)):
                raise
            _missing[name] = str(err)
            continue
        _loaded.append(name)
    _done.append(True)
    if _missing:
        import torch

        level = logging.INFO if torch.cuda.is_available() else logging.DEBUG
        reasons = sorted(set(_missing.values()))
        logger.log(level, "%d backend modules not loaded (%s), their torch paths run: %s", len(_missing),
                   "; ".join(reasons), ", ".join(n.rsplit(".", 1)[-1] for n in _missing))
    return list(_loaded)
