"""Fixed-size KV cache blocks: reference-counted blocks, per-sequence block tables, and
(with a PrefixCache) the full blocks sequences share by content."""

from __future__ import annotations

from collections import Counter, deque

from engine.prefix_cache import PrefixCache
from engine.sequence import Sequence


class BlockManager:
    """Hands out the cache's blocks 0..num_blocks-1. With `num_reserved`, the cache's last
    blocks are kept out of the free list for good (`reserved`): the decode CUDA graphs'
    padding rows write and read there, so they touch no sequence's tokens.

    With `num_state_slots`, every sequence holding blocks also holds one slot of the
    model's fixed per-sequence state (engine/models/base.py StateSpec), taken with its
    first block and given back with its blocks; a sequence cannot grow without one.

    With `prefix_cache`, a block counts the sequences whose tables hold it; a full block
    whose positions are all computed is indexed by its content (`commit`), a sequence
    being admitted starts with the indexed blocks its tokens begin with (`cached_prefix`),
    and a released indexed block stays in the index, unused, until a block is needed and
    no never-indexed one is free (engine/prefix_cache.py)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_reserved: int = 0,
        num_state_slots: int = 0,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if not 0 <= num_reserved < num_blocks:
            raise ValueError(
                f"cannot reserve {num_reserved} of {num_blocks} blocks: at least one must "
                "remain for sequences"
            )
        if prefix_cache is not None and prefix_cache.block_size != block_size:
            raise ValueError(
                f"prefix cache keys blocks of {prefix_cache.block_size} tokens, the cache's "
                f"blocks hold {block_size}"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks - num_reserved  # blocks sequences can own
        self.reserved = tuple(range(self.num_blocks, num_blocks))
        self.free: deque[int] = deque(range(self.num_blocks))  # unreferenced, not indexed
        self.refs = [0] * self.num_blocks
        self.cache = prefix_cache
        # keys of full prompt blocks that running sequences are computing now: a waiting
        # sequence that would compute one of them too waits for it instead (waits_for_prefix)
        self.computing: Counter[bytes] = Counter()
        self.uses_state = num_state_slots > 0
        self.free_state_slots: deque[int] = deque(range(num_state_slots))

    @property
    def caches_prefixes(self) -> bool:
        return self.cache is not None

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so the sequence can hold `num_tokens` tokens in total."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_table))

    def _needs_slot(self, seq: Sequence) -> bool:
        return self.uses_state and seq.state_slot is None

    # -- prefixes ---------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The indexed blocks a sequence holding no blocks can start with (none without a
        prefix cache): pass them to can_grow and grow."""
        if self.cache is None or seq.block_table:
            return []
        return self.cache.lookup(seq)

    def waits_for_prefix(self, seq: Sequence) -> bool:
        """Whether the next block this waiting sequence would compute is being computed by
        a running sequence now: admitted a step later, it reads that block instead."""
        if self.cache is None or not self.computing:
            return False
        key = self.cache.first_missing_key(seq, len(self.cached_prefix(seq)))
        return key is not None and key in self.computing

    def _unused_in(self, prefix: list[int]) -> int:
        return sum(1 for b in prefix if self.refs[b] == 0)

    # -- growing ----------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_tokens: int, prefix: list[int] | None = None) -> bool:
        """Whether the sequence can hold `num_tokens` tokens, starting (when it holds no
        blocks) with the cached `prefix`: unused prefix blocks leave the evictable pool."""
        if self._needs_slot(seq) and not self.free_state_slots:
            return False
        prefix = prefix or []
        new = max(0, -(-num_tokens // self.block_size) - len(seq.block_table) - len(prefix))
        return new <= self.num_free - self._unused_in(prefix)

    def grow(self, seq: Sequence, num_tokens: int, prefix: list[int] | None = None) -> None:
        if self._needs_slot(seq):
            seq.state_slot = self.free_state_slots.popleft()
        if prefix:
            assert not seq.block_table, "a cached prefix starts a sequence holding no blocks"
            for block in prefix:
                self._take(block)
            seq.block_table = list(prefix)
            seq.num_committed = len(prefix)
            seq.num_computed = len(prefix) * self.block_size
        if seq.cached_prompt_tokens is None:  # the sequence's first admission
            seq.cached_prompt_tokens = min(seq.num_computed, seq.num_prompt_tokens)
        if self.cache is not None and not seq.num_announced:
            self._announce(seq)
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block = self._allocate()
            self.refs[block] = 1
            seq.block_table.append(block)

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.cache.unused[block]
        self.refs[block] += 1

    def _allocate(self) -> int:
        if self.free:
            return self.free.popleft()
        return self.cache.evict()

    def _announce(self, seq: Sequence) -> None:
        """Record the keys of the full prompt blocks the sequence is about to compute."""
        end = self.cache.keyable_blocks(seq, seq.num_prompt_tokens - 1)
        keys = self.cache.keys(seq, end)
        for j in range(seq.num_committed, end):
            self.computing[keys[j]] += 1
        seq.num_announced = end

    def _retire(self, key: bytes) -> None:
        left = self.computing[key] - 1
        if left:
            self.computing[key] = left
        else:
            del self.computing[key]

    # -- indexing and release ---------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Index the sequence's full blocks whose positions are all computed (no-op
        without a prefix cache). Call after the steps that computed them."""
        cache = self.cache
        if cache is None:
            return
        end = min(cache.keyable_blocks(seq, seq.num_computed), len(seq.block_table))
        if seq.num_committed >= end:
            return
        keys = cache.keys(seq, end)
        for j in range(seq.num_committed, end):
            if j < seq.num_announced:
                self._retire(keys[j])
            cache.insert(keys[j], seq.block_table[j])
        seq.num_committed = end

    def release(self, seq: Sequence) -> None:
        self.commit(seq)
        for j in range(seq.num_committed, seq.num_announced):
            self._retire(seq.block_keys[j])
        # Last block first: the LRU then evicts a chain's tail before its head, and a
        # head evicted first would leave its tail unreachable.
        for block in reversed(seq.block_table):
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            if self.cache is not None and self.cache.is_indexed(block):
                self.cache.unused[block] = None
            else:
                self.free.append(block)
        seq.block_table = []
        seq.num_committed = seq.num_announced = 0
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        # The K/V went with the blocks: after a preemption every token must be recomputed
        # (or read back from the prefix cache, when its blocks are still indexed).
        seq.num_computed = 0

    def replace_prefix_cache(self, cache: PrefixCache | None) -> None:
        """Start over with `cache` (None: no prefix caching) while no sequence holds a
        block: every indexed block goes back to the free list."""
        if any(self.refs):
            raise RuntimeError("the prefix cache can be replaced only while no sequence runs")
        if cache is not None and cache.block_size != self.block_size:
            raise ValueError(
                f"prefix cache of {cache.block_size}-token blocks, not {self.block_size}"
            )
        if self.cache is not None:
            self.free.extend(self.cache.unused)
        self.cache = cache
        self.computing.clear()

    @property
    def num_free(self) -> int:
        """Blocks a sequence can be given: free ones and unused indexed ones."""
        return len(self.free) + (len(self.cache.unused) if self.cache is not None else 0)
