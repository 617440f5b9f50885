"""The engine's routing-trace recorder: attached to the MoE layers like `ExpertLoadStats`.

Per step the runner calls `begin_step(positions_T)`, then every MoE layer calls `record(layer,
topk_ids_TK, topk_weights_TK, logits_TE)`. Rows are copied into preallocated device chunks of
`chunk_tokens` rows (one slice copy per tensor, no host sync: T is a host shape); a full chunk is
copied to host memory asynchronously (pinned on CUDA) and a new one started. `trace()` is the
flush: the one sync, on demand. A step whose forward did not reach every MoE layer (it raised) is
discarded at the next `begin_step`. After `max_tokens` rows the recorder stops and the trace says
`truncated`. CUDA-graph replay is off while a recorder is attached (`graph_blocker`), so no
padding rows reach it.

Legend: L MoE layers, T tokens of the step, K top-k, E experts, C chunk rows.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from moe_infer.routing.trace import RoutingTrace, ids_dtype

logger = logging.getLogger(__name__)

_TORCH_IDS = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int16): torch.int16, np.dtype(np.int32): torch.int32}


class _Chunk:
    """Device buffers of C rows for every MoE layer (ids, weights, optional logits) and positions."""

    def __init__(self, L: int, C: int, K: int, E: int, ids_dtype: torch.dtype, with_logits: bool, device) -> None:
        self.ids_LCK = torch.empty(L, C, K, dtype=ids_dtype, device=device)
        self.weights_LCK = torch.empty(L, C, K, dtype=torch.float16, device=device)
        self.logits_LCE = torch.empty(L, C, E, dtype=torch.float32, device=device) if with_logits else None
        self.position_C = torch.empty(C, dtype=torch.int32, device=device)
        self.step_C = np.empty(C, dtype=np.int32)  # host: the step number is a host int
        self.rows = 0  # rows of complete steps

    def to_host(self) -> Dict[str, Any]:
        """Asynchronous copy of the used rows (pinned host memory on CUDA)."""
        n = self.rows
        out: Dict[str, Any] = {"step": self.step_C[:n].copy()}
        for name in ("ids_LCK", "weights_LCK", "logits_LCE", "position_C"):
            t = getattr(self, name)
            if t is None:
                continue
            t = t[:, :n] if t.dim() == 3 else t[:n]
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            out[name] = host.copy_(t, non_blocking=True)
        return out


class RoutingTraceRecorder:
    def __init__(self, moe_layer_ids: Sequence[int], num_experts: int, top_k: int, device: torch.device | str,
                 record_logits: bool = False, max_tokens: int = 1_000_000, chunk_tokens: int = 65536) -> None:
        if max_tokens <= 0 or chunk_tokens <= 0:
            raise ValueError(f"max_tokens ({max_tokens}) and chunk_tokens ({chunk_tokens}) must be positive")
        self.moe_layer_ids = list(moe_layer_ids)
        self._row_of_layer = {layer: i for i, layer in enumerate(self.moe_layer_ids)}
        self.num_experts, self.top_k, self.device = num_experts, top_k, torch.device(device)
        self.record_logits, self.max_tokens = record_logits, max_tokens
        self.chunk_tokens = min(chunk_tokens, max_tokens)
        self._ids_dtype = _TORCH_IDS[ids_dtype(num_experts)]
        self.reset()

    def reset(self) -> None:
        self._host: List[Dict[str, Any]] = []
        self._chunk: Optional[_Chunk] = None
        self._num_rows = 0  # rows of complete steps, host chunks included
        self._step = -1
        self._step_rows = 0  # T of the open step (0: none)
        self._written: set = set()
        self.truncated = False

    @property
    def num_tokens(self) -> int:
        """Token rows of complete steps recorded so far (the open step not counted)."""
        return self._num_rows

    def _close_step(self) -> None:
        T, self._step_rows = self._step_rows, 0
        if T and len(self._written) == len(self.moe_layer_ids):  # every MoE layer recorded it
            self._chunk.rows += T
            self._num_rows += T
        self._written = set()

    def begin_step(self, positions_T: Optional[torch.Tensor], num_tokens: int) -> None:
        """A new forward of `num_tokens` rows starts (positions_T int [T] on the device, or None)."""
        self._close_step()
        self._step += 1
        if self._num_rows + num_tokens > self.max_tokens:
            if not self.truncated:
                logger.warning("routing trace full at %d token rows (routing.trace_max_tokens); "
                               "later steps are not recorded", self._num_rows)
            self.truncated = True
            return
        C = max(self.chunk_tokens, num_tokens)
        if self._chunk is None or self._chunk.rows + num_tokens > self._chunk.step_C.shape[0]:
            if self._chunk is not None and self._chunk.rows:
                self._host.append(self._chunk.to_host())
            self._chunk = _Chunk(len(self.moe_layer_ids), C, self.top_k, self.num_experts, self._ids_dtype,
                                 self.record_logits, self.device)
        a, b = self._chunk.rows, self._chunk.rows + num_tokens
        self._chunk.step_C[a:b] = self._step
        if positions_T is None:
            self._chunk.position_C[a:b].fill_(-1)
        else:
            self._chunk.position_C[a:b].copy_(positions_T, non_blocking=True)
        self._step_rows = num_tokens

    def record(self, layer: int, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
               logits_TE: Optional[torch.Tensor] = None) -> None:
        """Copy one MoE layer's routing of the open step (ignored outside a step or once full)."""
        if not self._step_rows:
            return
        T = topk_ids_TK.shape[0]
        if T != self._step_rows:
            raise ValueError(f"routing trace: layer {layer} routed {T} tokens, the step has {self._step_rows}")
        l, a = self._row_of_layer[layer], self._chunk.rows
        self._chunk.ids_LCK[l, a:a + T].copy_(topk_ids_TK, non_blocking=True)
        self._chunk.weights_LCK[l, a:a + T].copy_(topk_weights_TK, non_blocking=True)
        if self._chunk.logits_LCE is not None and logits_TE is not None:
            self._chunk.logits_LCE[l, a:a + T].copy_(logits_TE, non_blocking=True)
        self._written.add(layer)

    def trace(self, info: Optional[Dict[str, Any]] = None) -> RoutingTrace:
        """Everything recorded so far as a RoutingTrace (this is where the host sync happens)."""
        self._close_step()
        parts = list(self._host)
        if self._chunk is not None and self._chunk.rows:
            parts.append(self._chunk.to_host())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        L, K, E = len(self.moe_layer_ids), self.top_k, self.num_experts

        def cat(name: str, axis: int, empty_shape) -> np.ndarray:
            arrays = [p[name].numpy() if name != "step" else p[name] for p in parts]
            return np.concatenate(arrays, axis=axis) if arrays else np.zeros(empty_shape)

        logits = cat("logits_LCE", 1, (L, 0, E)) if self.record_logits else None
        meta = dict(info or {})
        meta["truncated"] = self.truncated
        return RoutingTrace(cat("ids_LCK", 1, (L, 0, K)), cat("weights_LCK", 1, (L, 0, K)), cat("step", 0, (0,)),
                            E, self.moe_layer_ids, cat("position_C", 0, (0,)), logits, meta)
