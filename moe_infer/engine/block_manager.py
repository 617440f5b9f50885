"""Paged KV cache bookkeeping: block ids, ref counts and the prefix cache. No tensors here.

A sequence owns a block table (physical block ids, in order). A block is shared by several
sequences when they start with the same tokens: every full block whose KV has been computed gets
a hash chained with the previous block's hash (so equal hashes mean equal prefixes), and a new
request takes those blocks instead of recomputing them. A freed block (ref count 0) keeps its hash
and stays findable until the allocator reuses it, least recently freed first; the tail blocks of
a sequence are freed first, so the shared heads of prefixes are evicted last.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence as Seq, Tuple

from moe_infer.engine.sequence import Sequence


def hash_block(prev_hash: Optional[int], token_ids: Seq[int]) -> int:
    """Chained hash of a full block (int tuples hash the same in every process, unlike None)."""
    return hash((-1 if prev_hash is None else prev_hash, tuple(token_ids)))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[int] = None
        self.token_ids: Tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_id: Dict[int, int] = {}
        self.num_prefix_queries = 0  # full blocks looked up at admission
        self.num_prefix_hits = 0  # of those, found in the cache

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def find_cached_prefix(self, seq: Sequence) -> List[int]:
        """Block ids holding the KV of the longest cached prefix of seq (full blocks only).

        At least one token is always left to compute: the step that ends a prompt must produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        found, prev = [], None
        max_blocks = (len(seq) - 1) // self.block_size
        for i in range(max_blocks):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            prev = hash_block(prev, tokens)
            block_id = self.hash_to_id.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            found.append(block_id)
        return found

    # ------------------------------------------------------------------ admission
    def can_allocate(self, num_tokens: int, cached_ids: List[int]) -> bool:
        """Room for a new sequence of num_tokens whose prefix is in cached_ids?"""
        num_revived = sum(1 for b in cached_ids if self.blocks[b].ref_count == 0)  # leave the free list
        return self.blocks_needed(num_tokens) - len(cached_ids) + num_revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, cached_ids: List[int]) -> None:
        assert not seq.block_table, f"{seq} already holds blocks"
        self.num_prefix_queries += (len(seq) - 1) // self.block_size if self.enable_prefix_caching else 0
        self.num_prefix_hits += len(cached_ids)
        for block_id in cached_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached_ids) * self.block_size
        self._grow(seq, num_tokens)

    # ------------------------------------------------------------------ running sequences
    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Room for seq to hold num_tokens tokens in total?"""
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append(self, seq: Sequence, num_tokens: int) -> None:
        self._grow(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0  # a draft model's KV lives under the same block ids (speculative decoding)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past those that hold its first num_tokens tokens (speculative decoding: the KV
        slots of rejected tokens). Those blocks are its own (never full of computed tokens: no hash, no sharer)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_ids[block_id] = None

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Give every newly full block of computed tokens its chained hash (after a step ran)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:  # a block already holding a hash is a cache hit: nothing to do
                block.hash, block.token_ids = h, tokens
                self.hash_to_id.setdefault(h, block.block_id)

    # ------------------------------------------------------------------ internals
    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq} needs {need}, {self.num_free_blocks} free")
        free_ids, blocks, table, hash_to_id = self.free_ids, self.blocks, seq.block_table, self.hash_to_id
        for _ in range(need):  # the least recently freed first; one loop, no call per block (a prompt takes many)
            block_id = free_ids.popitem(last=False)[0]
            block = blocks[block_id]
            if block.hash is not None:  # a cached prefix block, evicted now
                if hash_to_id.get(block.hash) == block_id:
                    del hash_to_id[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            table.append(block_id)
