"""Fixed-size KV cache blocks: a free list and per-sequence block tables."""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    """Hands out the cache's blocks 0..num_blocks-1. With `num_reserved`, the cache's last
    blocks are kept out of the free list for good (`reserved`): the decode CUDA graphs'
    padding rows write and read there, so they touch no sequence's tokens.

    With `num_state_slots`, every sequence holding blocks also holds one slot of the
    model's fixed per-sequence state (engine/models/base.py StateSpec), taken with its
    first block and given back with its blocks; a sequence cannot grow without one."""

    def __init__(
        self, num_blocks: int, block_size: int, num_reserved: int = 0, num_state_slots: int = 0
    ) -> None:
        if not 0 <= num_reserved < num_blocks:
            raise ValueError(
                f"cannot reserve {num_reserved} of {num_blocks} blocks: at least one must "
                "remain for sequences"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks - num_reserved  # blocks sequences can own
        self.reserved = tuple(range(self.num_blocks, num_blocks))
        self.free: deque[int] = deque(range(self.num_blocks))
        self.uses_state = num_state_slots > 0
        self.free_state_slots: deque[int] = deque(range(num_state_slots))

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so the sequence can hold `num_tokens` tokens in total."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_table))

    def _needs_slot(self, seq: Sequence) -> bool:
        return self.uses_state and seq.state_slot is None

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        if self._needs_slot(seq) and not self.free_state_slots:
            return False
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        if self._needs_slot(seq):
            seq.state_slot = self.free_state_slots.popleft()
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self.free.popleft())

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.block_table)
        seq.block_table = []
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        # The K/V went with the blocks: after a preemption every token must be recomputed.
        seq.num_computed = 0

    @property
    def num_free(self) -> int:
        return len(self.free)
