"""DeepSeek-V4 attention on CUDA (the interface: engine/ops/v4_paged_attention.py; the decode
state's layout: engine/layers/v4_attention.py's docstring).

A decode step (one token per sequence) reads the step only from device tensors (positions,
ctx.state_slots, ctx.block_tables) and takes every launch shape from sizes known before
the step (B, the block tables' width, index_topk, max_model_len), so it never syncs the
host and a CUDA graph can capture it:

1. q, qr and the roped kv of all B rows (the layer's `query`, `key_value`);
2. kv into the ring at [slot, pos % ring_size], before the read: the attention kernel
   finds the query's own key there;
3. each compressor (the CSA indexer's too): the token's (kv, score + ape[pos % m]) into its
   pooling state at row pos % reach; every row then pools the window its token is in, as
   engine/ops/v4_compress.py's `_slots` and `_pool` do, and the rows whose token closes
   that window (pos % m == m - 1) write the entry to its paged row, the others write back
   what the row holds;
4. CSA: the indexer's scores over every entry the row's block table can hold, masked past
   the committed ones, top index_topk on the device -> sel [B, index_topk] int32, -1 padded;
5. kernels/triton/v4_attention.py over ring and entries with the sinks, then the layer's
   `output` (de-rotation, grouped wo_a, wo_b).

Prefill and mixed steps run the torch ops, which read the ring before writing it; the
state both leave is the same. Float32 models take the decode path too (the kernel computes
in IEEE float32 for them), so their decode step is capturable like a bf16 one.

Legend: docs/shapes.md (B sequences, H heads); m the compress ratio, reach the pooling
state's rows (m, or 2m with overlap, plus any speculative lookahead), W the projection width, d the entry width, S the slots an entry
pools (m, or 2m), n the entries a block table holds, Hi the indexer's heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.attention_context import AttentionContext
from engine.ops.device_layer import DeviceSetup, register
from engine.ops.v4_attention import apply_rope, rope_cos_sin
from engine.ops.v4_compress import indexer_topk, rms_norm, token_rows
from engine.ops.v4_paged_attention import TORCH_V4_ATTENTION, V4AttentionOps
from engine.spec_decode.mtp import MAX_DRAFTS
from kernels.cpu import batch_invariant


def paged_rows(tables: torch.Tensor, entries: torch.Tensor, ratio: int, block_size: int):
    """Rows of entries [B, ...] (indices per sequence) in a paged compressed cache viewed as
    [num_blocks * block_size // ratio, d]: entry w of sequence b lies in block
    tables[b, w * ratio // block_size] at row (w * ratio % block_size) // ratio."""
    per_block = block_size // ratio
    flat = entries.reshape(entries.shape[0], -1)
    pages = tables.long().gather(1, flat // per_block)
    return (pages * per_block + flat % per_block).view(entries.shape)


def decode_window_slots(state: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                        ratio: int, overlap: bool):  # fmt: skip
    """The pooling slots (kv, score) [B, S, d] of the window each row's token is in, from
    the pooling states [slots, 2, reach, W] that already hold the token (token q at row
    q % reach): `_slots`' layout (HCA: the window's m tokens in order; CSA: Ca of window
    w - 1, then Cb of window w, window -1's slots kv 0 and score -inf). Rows whose window
    is not closed yet read stale slots; their entries are never written."""
    reach = state.shape[2]
    start = positions // ratio * ratio  # [B]: the first token of the row's window
    offs = torch.arange(ratio, device=state.device)
    cur = (start[:, None] + offs) % reach  # [B, m]
    at = slots[:, None]
    if not overlap:
        return state[at, 0, cur], state[at, 1, cur]
    prev = (start[:, None] - ratio + offs) % reach  # window w - 1's rows
    d = state.shape[-1] // 2
    kv = torch.cat([state[at, 0, prev, :d], state[at, 0, cur, d:]], dim=1)  # [B, 2m, d]
    score = torch.cat([state[at, 1, prev, :d], state[at, 1, cur, d:]], dim=1)
    ca = torch.arange(2 * ratio, device=state.device) < ratio  # [2m]: the Ca slots
    none = (start == 0)[:, None, None] & ca[None, :, None]  # window -1's
    return torch.where(none, 0.0, kv), torch.where(none, float("-inf"), score)


def pool_at(kv: torch.Tensor, score: torch.Tensor, entry_pos: torch.Tensor, comp,
            dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """kv, score [B, S, d] float32 -> entries [B, d] in dtype, each roped at its own
    position entry_pos [B] (w * m): `_pool`'s arithmetic (the slot softmax spelled out),
    with a rope position per row instead of a run of consecutive entries."""
    weights = torch.exp(score - score.amax(dim=1, keepdim=True))
    pooled = (kv * (weights / weights.sum(dim=1, keepdim=True))).sum(dim=1)
    entries = rms_norm(pooled, comp.norm.weight, comp.eps)
    cos, sin = rope_cos_sin(entry_pos, comp.inv_freq)
    return apply_rope(entries, cos, sin).to(dtype)


def compress_decode(comp, cache, state, x, positions, slots, tables, block_size) -> None:
    """One decode token per row through a compressor: its rows into the pooling states
    [slots, 2, reach, W], and the entry its token commits into the paged `cache` [num_blocks,
    block_size // m, d]. Every row computes its window's entry; a row whose token does not
    close the window writes back what its target row holds (that row lies in the token's
    own block, since block_size is a multiple of m), so nothing branches on the host."""
    ratio = comp.ratio
    kv, score = comp.project(x)  # [B, W]
    rows = token_rows(kv, score, comp.ape, positions)  # [2, B, W]
    state[slots, :, positions % state.shape[2]] = rows.transpose(0, 1)
    slot_kv, slot_score = decode_window_slots(state, slots, positions, ratio, comp.overlap)
    window = positions // ratio
    entries = pool_at(slot_kv, slot_score, window * ratio, comp, kv.dtype)  # [B, d]
    flat = cache.view(-1, cache.shape[-1])
    target = paged_rows(tables, window[:, None], ratio, block_size)[:, 0]  # [B]
    closes = (positions % ratio == ratio - 1)[:, None]
    flat[target] = torch.where(closes, entries.to(flat.dtype), flat[target])


def indexer_selection(indexer, x, qr, positions, keys_cache, tables, block_size):
    """sel [B, index_topk] int32: each row's indexer top entries among every entry its
    block table can hold (n, a shape, not a length: the step's data does not size it),
    masked past its committed ones (w < (pos + 1) // m), -1 where it has fewer."""
    heads, dim = indexer.heads, indexer.head_dim
    n = tables.shape[1] * (block_size // indexer.ratio)
    w = torch.arange(n, device=x.device).expand(x.shape[0], n)
    keys = keys_cache.view(-1, dim)[paged_rows(tables, w, indexer.ratio, block_size)]
    q = indexer.wq_b(qr).view(-1, heads, dim)
    cos, sin = rope_cos_sin(positions, indexer.compressor.inv_freq)
    q = apply_rope(q, cos, sin)  # [B, Hi, d]
    # indexer_scores' arithmetic with each row's own keys [n, d]
    dots = batch_invariant.batched_matmul(q.float(), keys.float().transpose(1, 2))  # [B, Hi, n]
    dots = F.relu(dots) * dim**-0.5
    weights = indexer.weights_proj(x).float() * heads**-0.5  # [B, Hi]
    scores = (dots * weights[..., None]).sum(dim=1)  # [B, n]
    picked = indexer_topk(scores, positions, indexer.ratio, indexer.topk)  # [B, min(k, n)]
    return F.pad(picked, (0, indexer.topk - picked.shape[1]), value=-1).to(torch.int32)


def decode_indices(ctx: AttentionContext) -> tuple[torch.Tensor, ...]:
    """The step's state slots as indices (int64) and as the kernel reads them (int32), and
    the block tables as int32 (the graph runner's buffers are int64): once per step."""
    slots = ctx.state_slots
    return slots.long(), slots.to(torch.int32), ctx.block_tables.to(torch.int32)


class CudaV4AttentionOps(V4AttentionOps):
    # a decode step reads no host data: the graph runner may capture it
    captures_decode = True

    def __init__(self, attn, setup: DeviceSetup):
        if not attn.compress_ratio:
            self.mode = "sliding"
        else:
            self.mode = "hca" if attn.indexer is None else "csa"
        # The HCA kernel's split axis must cover every decode row's position: the
        # sequence's last row plus the MTP drafter's positions past it.
        self.max_position = setup.max_model_len + MAX_DRAFTS - 1

    def forward(self, attn, x, positions, ctx: AttentionContext):
        if not ctx.is_decode:
            return TORCH_V4_ATTENTION.forward(attn, x, positions, ctx)
        if ctx.state_slots is None:
            raise ValueError("V4 attention needs each sequence's state slot (ctx.state_slots)")
        from kernels.triton.v4_attention import v4_attention_decode

        slots, slots_i32, tables = ctx.shared("v4-decode-indices", lambda: decode_indices(ctx))
        cos, sin = attn.cos_sin(positions)
        q, qr = attn.query(x, cos, sin)  # [B, H, head_dim], [B, q_lora_rank]
        kv = attn.key_value(x, cos, sin)  # [B, head_dim]
        ring = attn.ring
        ring[slots, positions % ring.shape[1]] = kv.to(ring.dtype)
        entries = block_tables = sel = None
        if attn.compressor is not None:
            entries, block_tables = attn.entries, tables
            compress_decode(attn.compressor, entries, attn.pool_state, x, positions, slots,
                            tables, ctx.block_size)  # fmt: skip
        if attn.indexer is not None:
            compress_decode(attn.indexer.compressor, attn.index_keys, attn.index_pool_state,
                            x, positions, slots, tables, ctx.block_size)  # fmt: skip
            sel = indexer_selection(attn.indexer, x, qr, positions, attn.index_keys, tables,
                                    ctx.block_size)  # fmt: skip
        o = v4_attention_decode(
            q, ring, entries, positions, slots_i32, block_tables, attn.attn_sink,
            window=attn.sliding_window, ratio=attn.compress_ratio or 1, mode=self.mode,
            sel=sel, max_position=self.max_position,
        )  # fmt: skip
        return attn.output(o, cos, sin)


@register("v4_attention", "cuda")
def cuda_v4_attention_ops(attn, setup: DeviceSetup) -> V4AttentionOps:
    return CudaV4AttentionOps(attn, setup)
