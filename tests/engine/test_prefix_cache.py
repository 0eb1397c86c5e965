"""The prefix cache in the block manager: content keys, reference counts, the LRU of unused
indexed blocks, and the invariants a random workload must keep."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.prefix_cache import PrefixCache, block_key, cache_identity
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import PENDING_TOKEN, Sequence

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=4)
ROOT = cache_identity("test-model", 4)


def _seq(tokens: list[int], i: int = 0) -> Sequence:
    return Sequence(f"r{i}", 0, list(tokens), GREEDY, None, None)


def _manager(num_blocks: int = 16, key_next_token: bool = False, **kw) -> BlockManager:
    return BlockManager(num_blocks, BS, prefix_cache=PrefixCache(ROOT, BS, key_next_token), **kw)


def _computed(blocks: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """Give the sequence room for all its tokens and mark them computed (as a step would)."""
    start = blocks.cached_prefix(seq)
    blocks.grow(seq, len(seq) + 1, start)
    seq.num_computed = len(seq) if upto is None else upto
    blocks.commit(seq)


def test_keys_chain_the_prefix_and_the_identity():
    a = block_key(ROOT, [1, 2, 3, 4])
    assert a == block_key(ROOT, [1, 2, 3, 4])
    assert a != block_key(ROOT, [1, 2, 3, 5])
    assert a != block_key(cache_identity("other-model", 4), [1, 2, 3, 4])
    # the same tokens after another block are another block
    assert block_key(a, [5, 6, 7, 8]) != block_key(block_key(ROOT, [0, 2, 3, 4]), [5, 6, 7, 8])
    cache = PrefixCache(ROOT, BS)
    seq = _seq(list(range(1, 11)))
    assert cache.keys(seq, 2) == [a, block_key(a, [5, 6, 7, 8])]


def test_a_new_sequence_reuses_every_leading_full_block_but_computes_its_last_token():
    blocks = _manager()
    rng = random.Random(0)
    prefix = [rng.randrange(2, 300) for _ in range(3 * BS)]
    first = _seq(prefix + [7, 8])
    _computed(blocks, first)
    assert first.cached_prompt_tokens == 0
    shared = first.block_table[:3]

    second = _seq(prefix + [9])  # three full blocks, then its own
    hit = blocks.cached_prefix(second)
    assert hit == shared
    blocks.grow(second, len(second) + 1, hit)
    assert second.block_table[:3] == shared and second.num_computed == 3 * BS
    assert second.cached_prompt_tokens == 3 * BS
    assert [blocks.refs[b] for b in shared] == [2, 2, 2]

    # a prompt that is exactly the cached blocks recomputes the last block for its logits
    exact = _seq(prefix)
    assert blocks.cached_prefix(exact) == shared[:2]
    # a prompt differing in block 1 reuses block 0 only
    other = _seq(prefix[:BS] + [1] + prefix[BS + 1 :] + [5])
    assert blocks.cached_prefix(other) == shared[:1]


def test_partial_and_uncomputed_blocks_are_never_shared():
    blocks = _manager()
    tokens = list(range(2, 2 + 2 * BS + 2))
    seq = _seq(tokens)
    _computed(blocks, seq, upto=BS + 2)  # block 0 computed, block 1 half
    assert blocks.cached_prefix(_seq(tokens + [1])) == seq.block_table[:1]
    seq.num_computed = len(seq)
    blocks.commit(seq)
    assert blocks.cached_prefix(_seq(tokens + [1])) == seq.block_table[:2]  # not the partial 3rd


def test_pending_tokens_keep_their_block_out_of_the_index():
    blocks = _manager()
    seq = _seq(list(range(2, 2 + BS - 1)) + [PENDING_TOKEN])
    _computed(blocks, seq)  # the launched step computes the pending token's row
    assert not blocks.cache.block_of
    seq.token_ids[-1] = 77  # the step resolved
    blocks.commit(seq)
    assert blocks.cache.block_of == {block_key(ROOT, seq.token_ids[:BS]): seq.block_table[0]}


def test_with_key_next_token_a_block_waits_for_the_token_after_it():
    blocks = _manager(key_next_token=True)
    tokens = list(range(2, 2 + 2 * BS))
    seq = _seq(tokens)
    _computed(blocks, seq)  # two full blocks, but the token after block 1 is not known
    assert len(blocks.cache.block_of) == 1
    # another sequence with the same block 0 but another token after it does not match it
    assert blocks.cached_prefix(_seq(tokens[:BS] + [1, 2, 3])) == []
    assert blocks.cached_prefix(_seq(tokens[: BS + 1] + [1, 2])) == seq.block_table[:1]
    seq.token_ids.append(9)
    blocks.commit(seq)
    assert len(blocks.cache.block_of) == 2


def test_released_blocks_stay_indexed_until_space_is_needed_then_lru_goes_first():
    blocks = _manager(num_blocks=6)
    a = _seq(list(range(10, 10 + 2 * BS)) + [1])
    b = _seq(list(range(40, 40 + 2 * BS)) + [1])
    _computed(blocks, a)
    _computed(blocks, b)
    a_blocks, b_blocks = a.block_table[:2], b.block_table[:2]
    blocks.release(a)
    blocks.release(b)
    assert blocks.num_free == 6 and len(blocks.cache.unused) == 4
    # never-indexed free blocks are handed out before any indexed one is evicted
    filler = _seq(list(range(100, 102)))
    blocks.grow(filler, 2 * BS)
    assert not set(filler.block_table) & set(a_blocks + b_blocks)
    assert blocks.cache.num_evictions == 0
    # now eviction: a was released first, and a chain's tail goes before its head
    more = _seq(list(range(200, 202)))
    blocks.grow(more, BS)
    assert more.block_table == [a_blocks[1]]
    assert blocks.cached_prefix(_seq(a.token_ids[: 2 * BS] + [3])) == a_blocks[:1]
    # a reused block leaves the LRU: it cannot be evicted while a sequence holds it
    again = _seq(b.token_ids[: 2 * BS] + [3])
    hit = blocks.cached_prefix(again)
    assert hit == b_blocks
    blocks.grow(again, len(again) + 1, hit)
    assert not set(b_blocks) & set(blocks.cache.unused)


def test_can_grow_counts_unused_prefix_blocks_as_taken():
    blocks = _manager(num_blocks=3)
    a = _seq(list(range(10, 10 + 2 * BS)) + [1])
    _computed(blocks, a)
    blocks.release(a)
    assert blocks.num_free == 3
    same = _seq(a.token_ids[: 2 * BS] + [5])
    hit = blocks.cached_prefix(same)
    assert len(hit) == 2
    # the hit takes 2 of the 3 blocks: room for one more, not for two
    assert blocks.can_grow(same, 3 * BS, hit)
    assert not blocks.can_grow(same, 3 * BS + 1, hit)


def test_duplicate_content_computed_twice_keeps_one_indexed_block():
    blocks = _manager()
    tokens = list(range(3, 3 + BS)) + [1]
    a, b = _seq(tokens), _seq(tokens)
    blocks.grow(a, len(a) + 1)
    blocks.grow(b, len(b) + 1)
    for s in (a, b):
        s.num_computed = len(s)
        blocks.commit(s)
    assert blocks.cache.block_of[block_key(ROOT, tokens[:BS])] == a.block_table[0]
    blocks.release(b)  # its copy was never indexed: back to the free list
    assert b.block_table == [] and blocks.cache.unused == {}


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_reference_counts_and_every_position_right(seed):
    """Sequences drawn from a few shared prefixes grow, compute, commit and release at
    random. A stand-in for the K/V: computing position p writes the tokens up to p into
    its slot (what a real entry is a function of). After every operation each block is in
    exactly one of free, unused-indexed or held, its count equals the tables holding it,
    a computed position is never written into a shared or indexed block, and every
    computed position of every sequence holds what that sequence would have written."""
    rng = random.Random(seed)
    blocks = _manager(num_blocks=24)
    cache = blocks.cache
    slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> "K/V"
    prefixes = [[rng.randrange(2, 50) for _ in range(rng.randrange(0, 3 * BS))] for _ in range(3)]
    live: list[Sequence] = []
    for i in range(300):
        if live and rng.random() < 0.35:
            blocks.release(live.pop(rng.randrange(len(live))))
        elif live and rng.random() < 0.5:
            seq = rng.choice(live)
            end = min(len(seq), seq.num_computed + rng.randrange(1, 2 * BS))
            for p in range(seq.num_computed, end):
                block = seq.block_table[p // BS]
                assert blocks.refs[block] == 1 and not cache.is_indexed(block)
                slots[block, p % BS] = tuple(seq.token_ids[: p + 1])
            seq.num_computed = end
            blocks.commit(seq)
        else:
            tokens = rng.choice(prefixes) + [
                rng.randrange(2, 50) for _ in range(rng.randrange(1, 6))
            ]
            seq = _seq(tokens, i)
            hit = blocks.cached_prefix(seq)
            if blocks.can_grow(seq, len(seq) + 1, hit):
                blocks.grow(seq, len(seq) + 1, hit)
                assert seq.num_computed == len(hit) * BS < len(seq)
                live.append(seq)
        held: dict[int, int] = {}
        for s in live:
            for b in s.block_table:
                held[b] = held.get(b, 0) + 1
            for p in range(s.num_computed):
                assert slots[s.block_table[p // BS], p % BS] == tuple(s.token_ids[: p + 1])
        for b in range(blocks.num_blocks):
            assert blocks.refs[b] == held.get(b, 0)
        pools = [set(blocks.free), set(cache.unused), set(held)]
        assert sum(len(p) for p in pools) == blocks.num_blocks
        assert set().union(*pools) == set(range(blocks.num_blocks))
        assert set(cache.unused) <= set(cache.key_of)
    for s in live:
        blocks.release(s)
    assert blocks.num_free == blocks.num_blocks and not blocks.computing


def test_the_scheduler_prefills_a_shared_prefix_once_before_admitting_its_sharers():
    blocks = _manager(num_blocks=64)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=256)
    prefix = list(range(2, 2 + 5 * BS))
    seqs = [_seq(prefix + [100 + i], i) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    first = scheduler.schedule()
    assert first.seqs == [seqs[0]]  # the others wait for its blocks
    for s, n in zip(first.seqs, first.num_tokens):
        s.num_computed += n
        s.token_ids.append(1)  # its first token
    second = scheduler.schedule()
    assert second.seqs[1:] == seqs[1:]
    assert [s.cached_prompt_tokens for s in seqs] == [0] + [5 * BS] * 3
    assert second.num_tokens[1:] == [1, 1, 1]
    shared = seqs[0].block_table[:5]
    assert all(s.block_table[:5] == shared for s in seqs)
