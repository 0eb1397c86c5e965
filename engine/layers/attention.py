"""Paged multi-head / grouped-query attention in plain torch (the CPU path and the
reference the GPU kernels are tested against).

Each layer's cache is one tensor [num_blocks, block_size, 2, Hk, Dh] (K and V). New
tokens are written at ctx.slot_mapping, then each query attends causally over its own
sequence's cached tokens, gathered through the block table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.attention_context import AttentionContext
from kernels.cpu import batch_invariant


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


def _query_positions(ctx: AttentionContext, device: torch.device) -> torch.Tensor:
    """[B, Q] absolute position of each query of each sequence, queries padded to the
    longest chunk (a padding query repeats its sequence's last position)."""

    def make() -> torch.Tensor:
        qmax = max(ctx.query_lens_host)
        qlens = torch.tensor(ctx.query_lens_host, device=device)
        clens = torch.tensor(ctx.context_lens_host, device=device)
        steps = torch.minimum(torch.arange(qmax, device=device)[None, :], qlens[:, None] - 1)
        return (clens - qlens)[:, None] + steps

    return ctx.shared("query_positions", make)


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


def _fused_attention(
    q: torch.Tensor, cache: torch.Tensor, ctx: AttentionContext, scale: float
) -> torch.Tensor:
    """The faster forms, for `batch_invariant=False`: one fused SDPA call for decode, a
    padded einsum for prefill. A query's bits then depend on the step's other queries."""
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


def paged_attention(
    q: torch.Tensor, cache: torch.Tensor, ctx: AttentionContext, scale: float
) -> torch.Tensor:
    """q [T, H, Dh] -> out [T, H, Dh], causal over each sequence's cached context.

    Prefill chunks and decode steps go through the same batch-invariant attention
    (kernels/cpu/batch_invariant.py): a query's result depends only on its own sequence's
    keys, not on the chunk it came in, the other sequences or the padding, so a prompt
    chunked any way, or recomputed after a preemption, gives the same bits."""
    if not ctx.batch_invariant:
        return _fused_attention(q, cache, ctx, scale)
    T, H, Dh = q.shape
    B = ctx.num_seqs
    Hk = cache.shape[3]
    group = H // Hk
    flat = cache.view(-1, *cache.shape[2:])
    slots = gather_context_slots(ctx, q.device)  # [B, L]
    if q.device.type == "cpu":  # gathered at the padded length: no copy to pad it later
        extra = batch_invariant.padded_keys(slots.shape[1]) - slots.shape[1]
        slots = torch.cat((slots, slots.new_zeros(slots.shape[0], extra)), dim=1)
    kv = flat[slots]  # [B, L, 2, Hk, Dh]
    L = slots.shape[1]
    kv = kv.permute(2, 0, 3, 1, 4).contiguous()  # [2, B, Hk, L, Dh]: one copy for both
    k = kv[0].view(B * Hk, L, Dh)
    v = kv[1].view(B * Hk, L, Dh)

    qmax = max(ctx.query_lens_host)
    qpos = _query_positions(ctx, q.device)  # [B, Q]
    if ctx.is_decode:  # one query per sequence, in sequence order: no gather
        qb = q.view(B, 1, Hk, group, Dh)
    else:
        starts = ctx.cu_query_lens.to(q.device).long()[:-1]
        rows = starts[:, None] + (qpos - qpos[:, :1])  # [B, Q] row of each query in q
        qb = q[rows.flatten()].view(B, qmax, Hk, group, Dh)
    qb = qb.permute(0, 2, 3, 1, 4).reshape(B * Hk, group * qmax, Dh)  # [S, G*Q, Dh]
    visible = torch.arange(L, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, Q, L]
    visible = visible[:, None, None].expand(B, Hk, group, qmax, L).reshape(B * Hk, -1, L)
    res = batch_invariant.attention(qb, k, v, visible, scale)  # [S, G*Q, Dh] float32
    res = res.view(B, Hk, group, qmax, Dh).permute(0, 3, 1, 2, 4).reshape(B, qmax, H, Dh)
    if ctx.is_decode:
        return res.view(T, H, Dh).to(q.dtype)
    qlens = torch.tensor(ctx.query_lens_host, device=q.device)
    real = torch.arange(qmax, device=q.device)[None, :] < qlens[:, None]  # [B, Q]
    return res[real].to(q.dtype)  # [T, H, Dh], sequences in order
