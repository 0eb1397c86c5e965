"""Content-addressed KV blocks: the index of full blocks whose cache entries are final, so a
new sequence whose tokens start the same way reads them instead of computing them.

A block's key is a hash of the key before it (for block 0: the cache's identity, which
names the model, dtype, block size and cache layout) and of the block's tokens, so equal
keys mean the same tokens at the same positions after the same prefix: the block's K/V
(per-head K/V, MLA latents) are a function of exactly those. With `key_next_token` (the
MTP speculator) the token after the block is hashed in too: the MTP layer's cache entry at
position i reads the token at i + 1, so a block's last MTP entry depends on the first
token of the next block.

Only full blocks are ever shared, and a shared block is never written again: a block is
indexed once every one of its positions is computed, and a sequence that reuses a prefix
computes from the first position after it. So nothing is copied on write. A sequence
always computes at least its last token (its logits are what it samples from), so it
reuses at most the full blocks before its last token.

Blocks no sequence references stay indexed, in least-recently-released order, until the
allocator needs their space (BlockManager takes a never-indexed free block first).

Exactness: a reused block holds bitwise what the sequence would have computed only when
the attention path does not depend on where a prefill chunk starts or what else is in the
step (the batch-invariant CPU path, docs/batch-invariance.md); docs/prefix-caching.md says
where that holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.sequence import PENDING_TOKEN, Sequence

_KEY_BYTES = 16  # 128-bit keys: a collision would silently hand a row another's K/V


def cache_identity(*parts: object) -> bytes:
    """The root key: a hash of whatever makes two caches' contents differ for the same
    tokens (model, dtype, block size, cache layout, the speculator's MTP entries)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=_KEY_BYTES).digest()


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a block holding `tokens` after the block whose key is `parent`."""
    return _hash(parent + array("q", tokens).tobytes())


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_KEY_BYTES).digest()


class PrefixCache:
    """key -> block for indexed blocks, and the indexed blocks no sequence references, in
    the order they were released (the oldest is evicted first)."""

    def __init__(self, identity: bytes, block_size: int, key_next_token: bool = False) -> None:
        self.identity = identity
        self.block_size = block_size
        self.key_next_token = key_next_token
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.unused: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    # -- keys -------------------------------------------------------------------------
    def keyable_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """How many leading blocks of the sequence's first `num_tokens` tokens have a key:
        full, no token still being sampled (PENDING_TOKEN: only ever at the end), and with
        key_next_token the token after the block known."""
        tokens = seq.token_ids
        real = len(tokens)
        while real and tokens[real - 1] == PENDING_TOKEN:
            real -= 1
        return min(num_tokens, real - int(self.key_next_token)) // self.block_size

    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of the sequence's first `num_blocks` blocks (callers pass at most
        keyable_blocks), computed once per sequence: a keyed block's tokens never change.
        The new blocks' tokens are packed once and each key hashes its slice: a 2,000-token
        shared prefix is 125 keys for every row that is admitted, computed on the host
        while the GPU waits for the step."""
        keys = seq.block_keys
        first = len(keys)
        if first >= num_blocks:
            return keys
        bs = self.block_size
        extra = int(self.key_next_token)
        packed = array("q", seq.token_ids[first * bs : num_blocks * bs + extra]).tobytes()
        width, tail = 8 * bs, 8 * extra
        parent = keys[-1] if keys else self.identity
        for offset in range(0, (num_blocks - first) * width, width):
            parent = _hash(parent + packed[offset : offset + width + tail])
            keys.append(parent)
        return keys

    # -- the index --------------------------------------------------------------------
    def lookup(self, seq: Sequence) -> list[int]:
        """The indexed blocks the sequence can start with: its leading full blocks before
        its last token, as far as each one's key is indexed."""
        # Every key at once: the ones past the first miss are needed anyway, to index
        # the blocks once they are computed.
        limit = self.keyable_blocks(seq, len(seq) - 1)
        blocks: list[int] = []
        for key in self.keys(seq, limit)[:limit]:
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def first_missing_key(self, seq: Sequence, num_hit: int) -> bytes | None:
        """The key of the block after the sequence's `num_hit` cached ones, when it has one
        (it is a full block before the last token)."""
        if num_hit >= self.keyable_blocks(seq, len(seq) - 1):
            return None
        return self.keys(seq, num_hit + 1)[num_hit]

    def insert(self, key: bytes, block: int) -> bool:
        """Index a block whose entries are final; False when another block already holds
        that key (two sequences computed the same prefix at once): that one stays."""
        if key in self.block_of:
            return False
        self.block_of[key] = block
        self.key_of[block] = key
        return True

    def is_indexed(self, block: int) -> bool:
        return block in self.key_of

    def evict(self) -> int:
        """Drop the least recently released unused block from the index and return it."""
        block, _ = self.unused.popitem(last=False)
        del self.block_of[self.key_of.pop(block)]
        self.num_evictions += 1
        return block
