"""Launch configs of the fused MoE kernels: typed, stored as JSON per shape and device, keyed by
token count (nearest key wins), with a shape heuristic and a logged warning where no file matches.

File: configs/E={E},F={F},D={D},dtype={dtype},device={device}.json, written by
scripts/tune_fused_moe.py:  {"<num_tokens>": {"block_m": 16, "gate_up": {...}, "down": {...}}, ...}

The heuristic picks the decode shape (few rows per expert: BLOCK_M 16, narrow N tiles so that
enough CTAs stream the weights once) or the prefill shape (tensor-core tiles, grouped M order).

Legend: T tokens, D hidden, F expert intermediate, E local experts, K top-k.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from typing import Dict, Optional

logger = logging.getLogger(__name__)

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_tma: bool = False  # weights (and the down GEMM's rows) through TMA descriptors where aligned
    persistent: bool = False  # one program per SM loops over the tiles (fused_moe_persistent.py; not inline)
    flatten: bool = True  # persistent only: the tile and K loops software-pipelined as one
    one_dot: bool = False  # gate_up with use_tma: its gate and up tiles in one load and one dot (gate_up_one_dot)
    # down, persistent, flattened, 8 warps: its tile loop warp-specialised by Triton (TMA loads only, so where the
    # tensors do not allow TMA the plain loop runs); 4 warps compiled to 8-9x slower kernels on an H200
    warp_specialize: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {value}")
        if self.group_m < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad GemmConfig {self}")
        if self.warp_specialize and not (self.persistent and self.flatten and self.use_tma and self.num_warps == 8):
            raise ValueError(f"GemmConfig.warp_specialize needs persistent, flatten, use_tma and num_warps=8, got {self}")


@dataclass(frozen=True)
class FusedMoEConfig:
    block_m: int  # rows of one tile; every expert's rows are padded to a multiple of it
    gate_up: GemmConfig
    down: GemmConfig
    schedule: str = "auto"  # SCHEDULE_BACKENDS name (fused_moe_schedule.py); "auto" picks by row count
    combine: str = "kernel"  # COMBINE_MODES name (fused_moe.py): "kernel" after down, "tail" in its epilogue

    def __post_init__(self) -> None:
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"FusedMoEConfig.block_m must be a power of two >= 16, got {self.block_m}")
        if self.gate_up.warp_specialize:
            raise ValueError("GemmConfig.warp_specialize is for the down GEMM only: gate_up loads its rows by pointer, "
                             "which Triton's warp specialisation does not take")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "FusedMoEConfig":
        """Files written before `schedule` / `combine` existed read as "auto" / "kernel"."""
        return FusedMoEConfig(d["block_m"], GemmConfig(**d["gate_up"]), GemmConfig(**d["down"]),
                              d.get("schedule", "auto"), d.get("combine", "kernel"))


@functools.lru_cache(maxsize=None)
def device_name() -> str:
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def config_file_name(E: int, F: int, D: int, dtype_name: str, device: str) -> str:
    return f"E={E},F={F},D={D},dtype={dtype_name},device={device}.json"


@functools.lru_cache(maxsize=None)
def load_configs(E: int, F: int, D: int, dtype_name: str, device: str) -> Optional[Dict[int, FusedMoEConfig]]:
    path = os.path.join(CONFIG_DIR, config_file_name(E, F, D, dtype_name, device))
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    return {int(key): FusedMoEConfig.from_dict(value) for key, value in raw.items()}


def default_config(num_tokens: int, E: int, K: int, dtype_name: str = "bf16") -> FusedMoEConfig:
    """Shape heuristic: decode tiles while an expert gets few rows, tensor-core tiles after.
    float32 operands take half-depth K tiles and 2 stages so the tiles still fit in shared memory."""
    rows_per_expert = num_tokens * K / max(E, 1)
    if dtype_name == "fp32":
        return FusedMoEConfig(16 if rows_per_expert <= 16 else 64, GemmConfig(64, 32, 8, 4, 2), GemmConfig(64, 32, 8, 4, 2))
    if rows_per_expert <= 16:
        return FusedMoEConfig(16, GemmConfig(64, 128, 1, 4, 4), GemmConfig(64, 128, 1, 4, 4))
    if rows_per_expert <= 96:
        return FusedMoEConfig(64, GemmConfig(64, 64, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4))
    return FusedMoEConfig(128, GemmConfig(128, 64, 8, 8, 3), GemmConfig(128, 64, 8, 8, 4))


_warned: set = set()


def get_config(num_tokens: int, E: int, F: int, D: int, K: int, dtype_name: str,
               device: Optional[str] = None) -> FusedMoEConfig:
    device = device or device_name()
    table = load_configs(E, F, D, dtype_name, device)
    if table:
        return table[min(table, key=lambda key: (abs(key - num_tokens), key))]
    key = (E, F, D, dtype_name, device)
    if key not in _warned:
        _warned.add(key)
        logger.warning("no tuned fused MoE config %s in %s; using the shape heuristic",
                       config_file_name(*key), CONFIG_DIR)
    return default_config(num_tokens, E, K, dtype_name)
