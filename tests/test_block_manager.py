"""BlockManager: block tables, ref counts, prefix caching with chained hashes, eviction order."""
from __future__ import annotations

import pytest

from moe_infer.engine.block_manager import BlockManager, hash_block
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.engine.sequence import Sequence


def seq(tokens):
    return Sequence("r", list(tokens), SamplingParams())


def admit(bm, s, num_tokens=None):
    cached = bm.find_cached_prefix(s)
    n = len(s) if num_tokens is None else num_tokens
    assert bm.can_allocate(n, cached)
    bm.allocate(s, n, cached)
    return cached


def compute_all(bm, s):
    s.num_computed_tokens = len(s)
    bm.cache_computed_blocks(s)


def test_allocate_append_free_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    admit(bm, a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.can_append(a, 12) and bm.can_append(a, 32) and not bm.can_append(a, 33)
    bm.append(a, 13)
    assert len(a.block_table) == 4 and bm.num_free_blocks == 4
    bm.free(a)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.append(seq(range(3)), 100)


def test_prefix_shared_across_requests_with_ref_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(100, 110))  # 2 full blocks + 2 tokens
    admit(bm, a)
    compute_all(bm, a)
    assert len(a.block_hashes) == 2
    b = seq(list(range(100, 108)) + [1, 2, 3])  # same first 2 blocks
    cached = admit(bm, b)
    assert cached == a.block_table[:2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in cached] == [2, 2]
    c = seq(list(range(100, 104)) + [9, 9, 9, 9, 9])  # only the first block matches
    assert bm.find_cached_prefix(c) == a.block_table[:1]
    d = seq([100, 101, 102, 999, 104])  # differs inside the first block: no hit
    assert bm.find_cached_prefix(d) == []
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in cached] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_hash_chains_previous_block():
    # the same 4 tokens after different first blocks must not share a hash
    assert hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    admit(bm, a)
    compute_all(bm, a)
    assert bm.find_cached_prefix(seq([0, 2, 3, 4, 5, 6, 7, 8, 0])) == []


def test_a_block_recurring_at_another_position_is_not_a_hit():
    # a's 2nd block [5, 6, 7, 8] opens b: the same tokens, but their KV was computed after [1, 2, 3, 4]
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0])
    admit(bm, a)
    compute_all(bm, a)
    assert bm.find_cached_prefix(seq([5, 6, 7, 8, 9, 10, 11, 12, 0])) == []
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == a.block_table[:2]


def test_never_reuses_the_whole_prompt():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(8))
    admit(bm, a)
    compute_all(bm, a)
    same = seq(range(8))  # fully cached: one token must still be computed to get logits
    assert bm.find_cached_prefix(same) == a.block_table[:1]


def test_freed_blocks_stay_hashable_until_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq([1, 2, 3, 4, 9])
    cached = admit(bm, b)  # revives a's freed blocks
    assert cached == table[:2]
    bm.free(b)
    # the tail blocks were freed first: a new allocation evicts them before the shared head
    c = seq([7, 7, 7])
    admit(bm, c)
    assert table[0] not in c.block_table
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 9]))[:1] == table[:1]
    bm.free(c)
    d = seq(range(20, 28))  # takes all 4 blocks: every old hash is evicted
    admit(bm, d)
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 9])) == []


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    b = seq([1, 2, 3, 4, 8, 8, 8])  # 2 cached + 2 new = 4 blocks > 3
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2 and not bm.can_allocate(len(b), cached)
    assert bm.can_allocate(6, cached)


def test_disabled_prefix_caching():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(range(9))
    admit(bm, a)
    compute_all(bm, a)
    assert a.block_hashes == [] and bm.find_cached_prefix(seq(range(9))) == []


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)


def test_a_reused_block_forgets_its_old_prefix():
    """A freed, hashed block taken by a new sequence holds that sequence's K/V from then on: the old prefix must no
    longer be found there, and the block must take the new sequence's hash once computed."""
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq(range(10, 18))  # both blocks, full
    admit(bm, a)
    compute_all(bm, a)
    old = list(a.block_table)
    bm.free(a)
    assert bm.find_cached_prefix(seq(range(10, 19))) == old  # still cached while free
    b = seq(range(50, 58))  # evicts and reuses both
    assert admit(bm, b) == []
    assert sorted(b.block_table) == sorted(old)
    compute_all(bm, b)
    assert bm.find_cached_prefix(seq(range(10, 19))) == []  # a's prefix is gone
    assert bm.find_cached_prefix(seq(range(50, 59))) == b.block_table  # b's is found
    assert all(bm.hash_to_id[h] == i for h, i in zip(b.block_hashes, b.block_table))
    assert len(bm.hash_to_id) == 2  # a's entries were dropped at eviction
