"""Paged multi-head / grouped-query attention in plain torch (the CPU path and the
reference the GPU kernels are tested against).

Each layer's cache is one tensor [num_blocks, block_size, 2, Hk, Dh] (K and V). New
tokens are written at ctx.slot_mapping, then each query attends causally over its own
sequence's cached tokens, gathered through the block table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.attention_context import AttentionContext


def write_kv(cache: torch.Tensor, ctx: AttentionContext, k: torch.Tensor, v: torch.Tensor) -> None:
    flat = cache.view(-1, *cache.shape[2:])  # [slots, 2, Hk, Dh]
    flat[ctx.slot_mapping] = torch.stack((k, v), dim=1).to(cache.dtype)


def gather_context_slots(ctx: AttentionContext, device: torch.device) -> torch.Tensor:
    """[B, Lmax] flat cache slots of every context token of each sequence (0 past the end)."""

    def make() -> torch.Tensor:
        offsets = torch.arange(ctx.max_context_len, device=device)
        blocks = ctx.block_tables[:, offsets // ctx.block_size].long()  # [B, Lmax]
        return blocks * ctx.block_size + (offsets % ctx.block_size)

    return ctx.shared("context_slots", make)


def _decode_padding(ctx: AttentionContext, L: int, device: torch.device) -> torch.Tensor:
    """[B, 1, 1, L] True where a key position lies past the sequence's length."""

    def make() -> torch.Tensor:
        lens = ctx.context_lens.to(device)
        return (torch.arange(L, device=device)[None, :] >= lens[:, None])[:, None, None, :]

    return ctx.shared("decode_padding", make)


def _prefill_mask(ctx: AttentionContext, L: int, device: torch.device) -> torch.Tensor:
    """[B, 1, 1, Q, L] True where query q of sequence b may see key l (causal, in bounds)."""

    def make() -> torch.Tensor:
        qmax = max(ctx.query_lens_host)
        qlens = torch.tensor(ctx.query_lens_host, device=device)
        clens = torch.tensor(ctx.context_lens_host, device=device)
        qpos = (clens - qlens)[:, None] + torch.arange(qmax, device=device)[None, :]  # [B, Q]
        allowed = torch.arange(L, device=device)[None, None, :] <= qpos[:, :, None]
        return allowed[:, None, None]

    return ctx.shared("prefill_mask", make)


def paged_attention(
    q: torch.Tensor, cache: torch.Tensor, ctx: AttentionContext, scale: float
) -> torch.Tensor:
    """q [T, H, Dh] -> out [T, H, Dh], causal over each sequence's cached context."""
    T, H, Dh = q.shape
    B = ctx.num_seqs
    Hk = cache.shape[3]
    group = H // Hk
    flat = cache.view(-1, *cache.shape[2:])
    slots = gather_context_slots(ctx, q.device)  # [B, L]
    kv = flat[slots]  # [B, L, 2, Hk, Dh]
    k = kv[:, :, 0].float().transpose(1, 2)  # [B, Hk, L, Dh]
    v = kv[:, :, 1].float().transpose(1, 2)
    L = slots.shape[1]

    if ctx.is_decode:
        # One query per sequence: the G query heads sharing a kv head act as G "query
        # positions" over the same keys, so one fused SDPA call covers GQA (on the CPU it
        # is ~2x faster than scores + softmax + weighted sum as separate ops).
        qb = q.float().view(B, Hk, group, Dh)
        visible = ctx.shared("decode_visible", lambda: ~_decode_padding(ctx, L, q.device))
        out = F.scaled_dot_product_attention(qb, k, v, attn_mask=visible, scale=scale)
        return out.reshape(T, H, Dh).to(q.dtype)

    # Mixed prefill/decode step: pad queries per sequence to the longest chunk.
    qmax = max(ctx.query_lens_host)
    out = torch.empty(T, H, Dh, dtype=q.dtype, device=q.device)
    qpad = q.new_zeros(B, qmax, H, Dh, dtype=torch.float32)
    starts = ctx.cu_query_lens.tolist()
    for b in range(B):
        qpad[b, : ctx.query_lens_host[b]] = q[starts[b] : starts[b + 1]].float()
    qb = qpad.view(B, qmax, Hk, group, Dh).permute(0, 2, 3, 1, 4)  # [B, Hk, G, Q, Dh]
    scores = torch.einsum("bkgqd,bkld->bkgql", qb, k) * scale  # [B, Hk, G, Q, L]
    scores.masked_fill_(~_prefill_mask(ctx, L, q.device), float("-inf"))
    probs = scores.softmax(-1).nan_to_num_(0.0)  # padded query rows have no keys
    res = torch.einsum("bkgql,bkld->bkgqd", probs, v).permute(0, 3, 1, 2, 4)  # [B,Q,Hk,G,Dh]
    res = res.reshape(B, qmax, H, Dh)
    for b in range(B):
        out[starts[b] : starts[b + 1]] = res[b, : ctx.query_lens_host[b]].to(q.dtype)
    return out
