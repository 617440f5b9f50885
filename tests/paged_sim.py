"""A minimal hand-built paged-KV driver for model tests (no scheduler): sequences get blocks from a
shuffled free list, each step's AttentionMetadata is built by hand exactly as the runner's contract
says (forward_context.py), and the model's logits come back for every token of the step."""
from __future__ import annotations

from typing import Dict, List

import torch

from moe_infer.layers.forward_context import AttentionMetadata, forward_context


class PagedSim:
    def __init__(self, model, block_size: int = 4, num_blocks: int = 64, seed: int = 0, device="cpu") -> None:
        self.model, self.block_size, self.device = model, block_size, torch.device(device)
        # NaN: reading a slot never written poisons the output
        self.kv = model.allocate_kv_cache(num_blocks, block_size, device, fill=float("nan"))
        model.bind_kv_cache(self.kv)
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.blocks: Dict[int, List[int]] = {}
        self.num_cached: Dict[int, int] = {}

    def _slot(self, seq: int, pos: int) -> int:
        blocks = self.blocks.setdefault(seq, [])
        while len(blocks) <= pos // self.block_size:
            blocks.append(self.free.pop())
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def metadata(self, chunks: Dict[int, List[int]]) -> tuple:
        ids, pos, slots, starts, seq_lens = [], [], [], [0], []
        for seq, toks in chunks.items():
            start = self.num_cached.get(seq, 0)
            for j, tok in enumerate(toks):
                ids.append(tok)
                pos.append(start + j)
                slots.append(self._slot(seq, start + j))
            starts.append(starts[-1] + len(toks))
            seq_lens.append(start + len(toks))
        M = max(len(self.blocks[s]) for s in chunks)
        tables = [self.blocks[s] + [-1] * (M - len(self.blocks[s])) for s in chunks]
        dev = self.device
        attn = AttentionMetadata(
            positions_T=torch.tensor(pos, dtype=torch.int64, device=dev),
            slot_mapping_T=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables_BM=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_start_loc_B1=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens_B=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        return torch.tensor(ids, dtype=torch.int64, device=dev), attn

    def step(self, chunks: Dict[int, List[int]]) -> Dict[int, torch.Tensor]:
        """Run one step; returns seq -> float32 logits [len(chunk), V] of its tokens in this step."""
        ids_T, attn = self.metadata(chunks)
        with forward_context(attn):
            logits_TV = self.model.compute_logits(self.model(ids_T, attn.positions_T))
        out, t = {}, 0
        for seq, toks in chunks.items():
            out[seq] = logits_TV[t: t + len(toks)]
            t += len(toks)
            self.num_cached[seq] = self.num_cached.get(seq, 0) + len(toks)
        return out


def run_schedule(
    sim: PagedSim, tokens: Dict[int, List[int]], schedule: List[Dict[int, int]]
) -> Dict[int, torch.Tensor]:
    """schedule: per step, seq -> how many of its next tokens to feed. Returns seq -> logits [L, V]."""
    fed: Dict[int, int] = {s: 0 for s in tokens}
    logits: Dict[int, List[torch.Tensor]] = {s: [] for s in tokens}
    for plan in schedule:
        chunks = {s: tokens[s][fed[s]: fed[s] + n] for s, n in plan.items()}
        for s, lg in sim.step(chunks).items():
            logits[s].append(lg)
            fed[s] += len(chunks[s])
    return {s: torch.cat(v) for s, v in logits.items() if v}
