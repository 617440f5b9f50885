"""Teacher-forced scoring: the model's next-token logits at every position of held-out windows.

The engine's `generate` returns logits of sampled positions only; the quality of a capacity policy
is measured on every position of known text (as perplexity evaluations do), so this runs the
engine's own model (`load_model`, the routing policy's `MoEBackends`, the paged attention) on
whole windows as prefill steps: `windows_per_forward` windows per forward, each a fresh sequence
in its own KV blocks. One forward is one capacity-policy call per MoE layer, over all its tokens
(T = windows_per_forward x seq_len), as one engine prefill step of that many tokens.

Legend: W windows of a forward, Q window length, T = W*Q tokens, V vocabulary.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
import torch

from moe_infer.config import EngineConfig, RoutingConfig
from moe_infer.engine.backends import resolve_moe_backends
from moe_infer.layers.forward_context import AttentionMetadata, forward_context
from moe_infer.models import load_model
from moe_infer.routing.stats import ExpertLoadStats
from moe_infer.routing.trace_recorder import RoutingTraceRecorder

BLOCK_SIZE = 16


class PrefillScorer:
    def __init__(self, model_path: str, routing: RoutingConfig, windows_per_forward: int, seq_len: int,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, record_trace: bool = False,
                 quantization: Optional[str] = None) -> None:
        """quantization: "fp8" / "int4", the weights quantized at load (moe_infer/models/online_quant.py)."""
        self.device, self.seq_len, self.windows_per_forward = torch.device(device), seq_len, windows_per_forward
        cfg = EngineConfig(routing=routing)
        backends = resolve_moe_backends(cfg, self.device)
        self.model = load_model(model_path, dtype, self.device, backends, quantization=quantization)
        arch = self.model.arch
        if seq_len > arch.max_position_embeddings:
            raise ValueError(f"lab.data.seq_len={seq_len} exceeds the model's {arch.max_position_embeddings} positions")
        self.stats = ExpertLoadStats(arch.num_layers, arch.num_experts, self.device)
        backends.stats = self.stats
        self.trace = (RoutingTraceRecorder(arch.moe_layer_ids, arch.num_experts, arch.top_k, self.device,
                                           record_logits=True) if record_trace else None)
        backends.trace = self.trace
        self.blocks_per_window = math.ceil(seq_len / BLOCK_SIZE)
        num_blocks = windows_per_forward * self.blocks_per_window
        self.model.bind_kv_cache(self.model.allocate_kv_cache(num_blocks, BLOCK_SIZE, self.device))

    def _metadata(self, W: int) -> AttentionMetadata:
        Q, M, dev = self.seq_len, self.blocks_per_window, self.device
        positions_T = torch.arange(Q, device=dev).repeat(W)
        tables_WM = torch.arange(W * M, device=dev, dtype=torch.int32).view(W, M)
        slots_T = (tables_WM.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=dev)).view(W, -1)[:, :Q]
        return AttentionMetadata(
            positions_T=positions_T, slot_mapping_T=slots_T.reshape(-1), block_tables_BM=tables_WM,
            query_start_loc_B1=torch.arange(W + 1, device=dev, dtype=torch.int32) * Q,
            seq_lens_B=torch.full((W,), Q, device=dev, dtype=torch.int32), max_query_len=Q, max_seq_len=Q,
            block_size=BLOCK_SIZE)

    @torch.inference_mode()
    def logits(self, windows_WQ: np.ndarray) -> torch.Tensor:
        """float32 [W*Q, V]: logits after each token of W <= windows_per_forward windows (one forward)."""
        W, Q = windows_WQ.shape
        if Q != self.seq_len or not 0 < W <= self.windows_per_forward:
            raise ValueError(f"windows {windows_WQ.shape}: at most {self.windows_per_forward} of {self.seq_len} tokens")
        ids_T = torch.as_tensor(windows_WQ.reshape(-1), device=self.device)
        meta = self._metadata(W)
        if self.trace is not None:
            self.trace.begin_step(meta.positions_T, ids_T.shape[0])
        with forward_context(meta):
            hidden_TD = self.model(ids_T, meta.positions_T)
        return self.model.compute_logits(hidden_TD)

    def batches(self, windows_NQ: np.ndarray):
        """Yield (windows of one forward, their logits) over all windows."""
        for i in range(0, len(windows_NQ), self.windows_per_forward):
            chunk = windows_NQ[i:i + self.windows_per_forward]
            yield chunk, self.logits(chunk)

    def routing_trace(self, info: Optional[dict] = None):
        return None if self.trace is None else self.trace.trace(info)


def perplexity(scorer: PrefillScorer, windows_NQ: np.ndarray) -> Tuple[float, int]:
    """(exp of the mean next-token negative log-likelihood, the number of tokens scored): every position of each
    window but the last is scored against the window's next token, teacher-forced."""
    nll, count = 0.0, 0
    for chunk, logits in scorer.batches(windows_NQ):
        W, Q = chunk.shape
        logits_WQV = logits.view(W, Q, -1)[:, :-1].float()
        targets = torch.as_tensor(chunk[:, 1:], device=logits.device).reshape(-1)
        nll += torch.nn.functional.cross_entropy(logits_WQV.reshape(-1, logits_WQV.shape[-1]), targets,
                                                 reduction="sum").item()
        count += targets.numel()
    return math.exp(nll / count), count
