"""BlockManager: the free list, and the reserved blocks it never hands out (the decode
CUDA graphs' scratch block)."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _seq(i: int, length: int) -> Sequence:
    return Sequence(f"r{i}", 0, list(range(2, 2 + length)), GREEDY, None, None)


@pytest.mark.parametrize("reserved", [0, 1, 2])
def test_reserved_blocks_are_never_handed_out(reserved):
    rng = random.Random(reserved)
    blocks = BlockManager(10, 4, num_reserved=reserved)
    assert blocks.num_blocks == 10 - reserved == blocks.num_free
    assert blocks.reserved == tuple(range(10 - reserved, 10))
    seqs = [_seq(i, rng.randint(1, 9)) for i in range(30)]
    owned: list[Sequence] = []
    for seq in seqs:  # grow and release at random until the cache has been used up often
        if owned and rng.random() < 0.4:
            blocks.release(owned.pop(rng.randrange(len(owned))))
        tokens = len(seq) + rng.randint(0, 6)
        if blocks.can_grow(seq, tokens):
            blocks.grow(seq, tokens)
            owned.append(seq)
        held = [b for s in owned for b in s.block_table]
        assert len(held) == len(set(held))  # no block owned twice
        assert not set(held) & set(blocks.reserved)
        assert len(held) + blocks.num_free == blocks.num_blocks
    for seq in owned:
        blocks.release(seq)
    assert sorted(blocks.free) == list(range(10 - reserved))


def test_at_least_one_block_stays_for_sequences():
    with pytest.raises(ValueError, match="cannot reserve 2 of 2 blocks"):
        BlockManager(2, 4, num_reserved=2)
    assert BlockManager(2, 4, num_reserved=1).num_blocks == 1


def test_the_scheduler_counts_only_the_blocks_sequences_can_own():
    # 4 blocks of 4 tokens, one reserved: 12 tokens for sequences. A 12-token prompt needs
    # a 13th position for its first new token, so it can never run.
    scheduler = Scheduler(BlockManager(4, 4, num_reserved=1), 4, 64)
    fits, too_long = _seq(0, 11), _seq(1, 12)
    scheduler.add(fits)
    scheduler.add(too_long)
    assert scheduler.abort_unrunnable() == [too_long]
    batch = scheduler.schedule()
    assert batch.seqs == [fits] and 3 not in fits.block_table
