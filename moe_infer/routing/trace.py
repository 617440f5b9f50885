"""Routing traces: which experts every token chose in every MoE layer, as one file.

The engine writes them (`RoutingTraceRecorder`, `LLM.save_routing_trace`, the launcher's
`trace_out=`); the lab's synthetic generators write the same format; planners, sweeps and the
cluster simulator read it (`load_trace`).

File format (version 1): one safetensors file (`*.safetensors`), tensors

    topk_ids_LTK       uint8 when E <= 256, else int16 (E <= 32768) or int32: the router's top-k
                       choice of token t in MoE layer l (before any capacity policy), in the
                       router's order (highest score first)
    topk_weights_LTK   float16: the combine weights of those choices (after the router's top-k
                       renormalisation and scaling, before any capacity policy)
    step_T             int32: the engine step (forward) in which token row t ran; rows of one
                       step are contiguous, steps ascend
    position_T         int32: the token's position in its sequence (-1 where unknown)
    router_logits_LTE  float32, optional: the router's logits (recorded on request; float32 so that a
                       replayed reroute / drop-by-score policy ranks exactly as the engine did)

and the safetensors metadata (strings): `format` = "moe_infer.routing_trace", `version` = "1",
`num_experts`, `top_k`, `moe_layers` (JSON list: the model's layer index of each l) and `info`
(JSON object: model, prompts, policy, commit, device, created, source, ... free-form).

Legend: L MoE layers, T token rows, K top-k, E experts.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

FORMAT = "moe_infer.routing_trace"
VERSION = "1"


def ids_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type the expert ids of a trace with `num_experts` are stored in."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    return np.dtype(np.int16) if num_experts <= 32768 else np.dtype(np.int32)


@dataclass
class RoutingTrace:
    """A routing trace in memory: ids int32, weights/logits float32, numpy arrays."""

    topk_ids_LTK: np.ndarray
    topk_weights_LTK: np.ndarray
    step_T: np.ndarray
    num_experts: int
    moe_layers: List[int]
    position_T: Optional[np.ndarray] = None
    router_logits_LTE: Optional[np.ndarray] = None
    info: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.topk_ids_LTK = np.asarray(self.topk_ids_LTK, dtype=np.int32)
        self.topk_weights_LTK = np.asarray(self.topk_weights_LTK, dtype=np.float32)
        self.step_T = np.asarray(self.step_T, dtype=np.int32)
        if self.topk_ids_LTK.ndim != 3:
            raise ValueError(f"topk_ids must be [L, T, K], got shape {self.topk_ids_LTK.shape}")
        L, T, K = self.topk_ids_LTK.shape
        if self.topk_weights_LTK.shape != (L, T, K):
            raise ValueError(f"topk_weights {self.topk_weights_LTK.shape} must match topk_ids {(L, T, K)}")
        if self.step_T.shape != (T,):
            raise ValueError(f"step_T has shape {self.step_T.shape}, expected ({T},)")
        if len(self.moe_layers) != L:
            raise ValueError(f"moe_layers lists {len(self.moe_layers)} layers, the arrays have L={L}")
        if not 1 <= K <= self.num_experts:
            raise ValueError(f"top_k={K} must be in [1, num_experts={self.num_experts}]")
        if T and (self.topk_ids_LTK.min() < 0 or self.topk_ids_LTK.max() >= self.num_experts):
            raise ValueError(f"expert ids outside [0, {self.num_experts})")
        if T > 1 and np.any(np.diff(self.step_T) < 0):
            raise ValueError("step_T must be non-decreasing (rows of a step are contiguous)")
        self.position_T = (np.full(T, -1, np.int32) if self.position_T is None
                           else np.asarray(self.position_T, dtype=np.int32))
        if self.position_T.shape != (T,):
            raise ValueError(f"position_T has shape {self.position_T.shape}, expected ({T},)")
        if self.router_logits_LTE is not None:
            self.router_logits_LTE = np.asarray(self.router_logits_LTE, dtype=np.float32)
            if self.router_logits_LTE.shape != (L, T, self.num_experts):
                raise ValueError(f"router_logits {self.router_logits_LTE.shape} must be {(L, T, self.num_experts)}")

    @property
    def num_layers(self) -> int:
        return self.topk_ids_LTK.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.topk_ids_LTK.shape[1]

    @property
    def top_k(self) -> int:
        return self.topk_ids_LTK.shape[2]

    def step_bounds(self) -> np.ndarray:
        """int64 [num_steps + 1]: rows of step i are [b[i], b[i+1])."""
        starts = np.flatnonzero(np.diff(self.step_T)) + 1
        return np.concatenate([[0], starts, [self.num_tokens]]).astype(np.int64)

    def slice_tokens(self, start: int, stop: int) -> "RoutingTrace":
        """The rows [start, stop) as a trace of their own (same metadata)."""
        logits = None if self.router_logits_LTE is None else self.router_logits_LTE[:, start:stop]
        return RoutingTrace(self.topk_ids_LTK[:, start:stop], self.topk_weights_LTK[:, start:stop],
                            self.step_T[start:stop], self.num_experts, list(self.moe_layers),
                            self.position_T[start:stop], logits, dict(self.info))


def source_commit() -> str:
    """The code's git commit for a trace's metadata: $GIT_COMMIT, else `git rev-parse` of the package's
    checkout (suffixed "+dirty" with uncommitted changes), else "unknown" (an installed wheel)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def save_trace(trace: RoutingTrace, path: str) -> None:
    """Write `trace` to `path` (safetensors; see the module docstring for the layout)."""
    from safetensors.numpy import save_file

    tensors = {
        "topk_ids_LTK": np.ascontiguousarray(trace.topk_ids_LTK.astype(ids_dtype(trace.num_experts))),
        "topk_weights_LTK": np.ascontiguousarray(trace.topk_weights_LTK.astype(np.float16)),
        "step_T": np.ascontiguousarray(trace.step_T),
        "position_T": np.ascontiguousarray(trace.position_T),
    }
    if trace.router_logits_LTE is not None:
        tensors["router_logits_LTE"] = np.ascontiguousarray(trace.router_logits_LTE.astype(np.float32))
    meta = {"format": FORMAT, "version": VERSION, "num_experts": str(trace.num_experts),
            "top_k": str(trace.top_k), "moe_layers": json.dumps(list(trace.moe_layers)),
            "info": json.dumps(trace.info, default=str)}
    save_file(tensors, path, metadata=meta)


def load_trace(path: str) -> RoutingTrace:
    """Read a trace written by `save_trace`; a clear error naming the file for anything else."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not a routing trace (metadata format={meta.get('format')!r}, "
                                 f"expected {FORMAT!r})")
            if meta.get("version") != VERSION:
                raise ValueError(f"{path}: routing trace version {meta.get('version')!r}, this reader knows {VERSION}")
            names = set(f.keys())
            missing = {"topk_ids_LTK", "topk_weights_LTK", "step_T"} - names
            if missing:
                raise ValueError(f"{path}: routing trace lacks tensors {sorted(missing)}")
            arrays = {name: f.get_tensor(name) for name in names}
        num_experts, moe_layers = int(meta["num_experts"]), json.loads(meta["moe_layers"])
        info = json.loads(meta.get("info", "{}"))
    except (SafetensorError, KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read routing trace {path}: {type(err).__name__}: {err}") from err
    return RoutingTrace(arrays["topk_ids_LTK"], arrays["topk_weights_LTK"], arrays["step_T"], num_experts,
                        moe_layers, arrays.get("position_T"), arrays.get("router_logits_LTE"), info)
