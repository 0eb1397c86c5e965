"""DeepSeek-V4 attention over the engine's decode state: the interface and its torch
implementation (the CPU's, and the oracle a GPU kernel is tested against).

The state (engine/layers/v4_attention.py's docstring) is per layer: a window ring and
the compressors' pooling rows in the sequence's state slot (ctx.state_slots), and the
committed compressed entries (and CSA's indexer keys) paged through the sequence's block
table. A step's tokens of one sequence, positions start..start+n-1, run as:

1. project q, qr and the roped kv of every token (row-wise, all sequences at once);
2. per sequence: the window keys are the ring's positions start-W+1..start-1 (read
   before this step writes the ring) followed by the step's own kv, so a chunk longer
   than the ring and a chunk splitting a window both see exactly their window;
3. the compressors take the chunk after their pooling state, commit the entries whose
   window closes in it into the paged caches, and the queries read every committed entry
   (HCA) or the indexer's selection among them (CSA), in one softmax with the window;
4. the chunk's last ring_size kv go into the ring; then de-rotation and the output
   projections for every token at once.

A query's result reads only its own sequence's state, and the compressors' arithmetic
does not depend on how a prompt was chunked (engine/ops/v4_compress.py), so prefill,
chunked prefill, decode and recompute after preemption give the same entries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.ops.attention_context import AttentionContext
from engine.ops.device_layer import DeviceSetup, register
from kernels.cpu import batch_invariant


class V4AttentionOps(ABC):
    @abstractmethod
    def forward(
        self, attn, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """x [T, D] of the step's sequences at positions [T] -> [T, D], updating each
        sequence's window ring, pooling state and compressed caches."""


def entry_rows(
    block_table: torch.Tensor, first: int, count: int, ratio: int, block_size: int
) -> torch.Tensor:
    """Rows of entries first..first+count-1 of one sequence in a paged compressed cache
    viewed as [num_blocks * block_size // ratio, ...]: entry w lies in block
    block_table[w * ratio // block_size] at row (w * ratio % block_size) // ratio."""
    per_block = block_size // ratio
    w = torch.arange(first, first + count, device=block_table.device)
    return block_table.long()[w // per_block] * per_block + w % per_block


class TorchV4AttentionOps(V4AttentionOps):
    def forward(self, attn, x, positions, ctx):
        if ctx.state_slots_host is None:
            raise ValueError("V4 attention needs each sequence's state slot (ctx.state_slots)")
        cos, sin = attn.cos_sin(positions)
        q, qr = attn.query(x, cos, sin)
        kv = attn.key_value(x, cos, sin)
        out = torch.empty_like(q)
        row = 0
        for b, n in enumerate(ctx.query_lens_host):
            rows = slice(row, row + n)
            row += n
            start = ctx.context_lens_host[b] - n
            slot = ctx.state_slots_host[b]
            out[rows] = self._sequence(
                attn, x[rows], q[rows], qr[rows], kv[rows], positions[rows], start, slot,
                ctx.block_tables[b], ctx.block_size,
            )  # fmt: skip
        return attn.output(out, cos, sin)

    def _sequence(self, attn, x, q, qr, kv, positions, start, slot, table, block_size):
        ring = attn.ring[slot]  # [ring_size, head_dim]
        entries = visible = None
        if attn.compressor is not None:
            entries = self._compress(
                attn.compressor, attn.entries, attn.pool_state[slot], x, start, table, block_size
            )
            index_keys = None
            if attn.indexer is not None:
                index_keys = self._compress(
                    attn.indexer.compressor, attn.index_keys, attn.index_pool_state[slot],
                    x, start, table, block_size,
                )  # fmt: skip
            visible = attn.entries_visible(x, qr, positions, index_keys, entries.shape[0])
        o = window_and_entries_attention(attn, q, kv, ring, positions, start, entries, visible)
        size = ring.shape[0]
        keep = min(kv.shape[0], size)
        ring[positions[-keep:] % size] = kv[-keep:].to(ring.dtype)
        return o

    @staticmethod
    def _compress(comp, cache, state, x, start, table, block_size):
        """Commit the chunk's closed windows into `cache` and return every committed entry
        of the sequence [n, d] in the cache's dtype."""
        new, first = comp.chunk_entries(x, start, state)
        flat = cache.view(-1, cache.shape[-1])
        if new.shape[0]:
            flat[entry_rows(table, first, new.shape[0], comp.ratio, block_size)] = new.to(
                flat.dtype
            )
        n = (start + x.shape[0]) // comp.ratio
        return flat[entry_rows(table, 0, n, comp.ratio, block_size)]


# queries whose keys are gathered at once: bounds the [queries, keys, head_dim] gather
QUERY_GROUP = 256


def window_and_entries_attention(attn, q, kv, ring, positions, start, entries, visible):
    """One sequence's queries q [n, H, head_dim] at positions start.. over their window
    and the compressed entries [n_e, head_dim] they see (visible [n, n_e]) -> [n, H,
    head_dim], batch-invariant (kernels/cpu/batch_invariant.attention).

    Each query's keys are laid out canonically, so its arithmetic does not depend on the
    chunk it came in: key j < window is the window position p with p % window == j
    (from the ring, at p % ring_size, for p < start, else from the chunk's own kv), then
    the entries in index order. A chunk or a whole prompt gives a query the same keys at
    the same places, whatever the ring's size (it is larger than the window by the
    speculative lookahead), and entries it does not see are masked padding."""
    n, H, hd = q.shape
    size, window = ring.shape[0], attn.sliding_window
    out = torch.empty_like(q)
    slots = torch.arange(window, device=q.device)
    for g in range(0, n, QUERY_GROUP):
        t = positions[g : g + QUERY_GROUP]  # [G]
        pos = t[:, None] - (t[:, None] - slots[None, :]) % window  # [G, window]: p = j mod W
        seen = pos >= 0
        from_chunk = pos >= start
        keys = ring[pos.clamp(min=0) % size].to(kv.dtype)  # [G, window, hd]
        own = kv[(pos - start).clamp(min=0, max=kv.shape[0] - 1)]
        keys = torch.where(from_chunk[..., None], own, keys)
        if entries is not None:
            keys = torch.cat([keys, entries.to(kv.dtype).expand(len(t), -1, -1)], dim=1)
            seen = torch.cat([seen, visible[g : g + QUERY_GROUP]], dim=1)
        G = len(t)
        sink = attn.attn_sink.float().expand(G, H)
        seen = seen[:, None, :].expand(G, H, seen.shape[-1])
        res = batch_invariant.attention(q[g : g + G], keys, keys, seen, attn.scale, sink)
        out[g : g + G] = res.to(q.dtype)
    return out


TORCH_V4_ATTENTION = TorchV4AttentionOps()


@register("v4_attention", "cpu")
def torch_v4_attention_ops(attn, setup: DeviceSetup) -> V4AttentionOps:
    return TORCH_V4_ATTENTION
