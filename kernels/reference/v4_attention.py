"""Torch twin of kernels/triton/v4_attention.py: one DeepSeek-V4 decode query per sequence
over the engine's decode state (window ring, paged compressed entries), softmax with a
per-head sink. The kernel's tests compare against it; it loops over rows and reads each
row's position back to the host, so it is an oracle, not a decode path.

Legend: docs/shapes.md (B sequences, one query each; H heads; L the keys a query sees).
Sizes without a letter: `head_dim` (512 in V4-Flash, one MQA head that is also the
value), `slots` (sequence state slots), `ring_size` (>= window), `ratio` (m: 4 for CSA,
128 for HCA), `index_topk` (the CSA selection's width).
  q [B, H, head_dim]                       normed and roped
  ring [slots, ring_size, head_dim]        position p of the sequence in slot s at
                                           ring[s, p % ring_size]
  cache [num_blocks, block_size // ratio, head_dim]
                                           entry w at cache[block_tables[b, w * ratio //
                                           block_size], (w * ratio % block_size) // ratio]
  positions [B], state_slots [B], block_tables [B, max_blocks] int32, sinks [H] float32
  sel [B, index_topk] int32                CSA: the indexer's entries, -1 = none
  o [B, H, head_dim] in q's dtype          not de-rotated
The query at position t sees the window positions max(0, t - window + 1) .. t (its own key
is in the ring) and the entries: none (sliding), every w < (t + 1) // ratio (HCA), the
selection's (CSA).
"""

from __future__ import annotations

import torch

MODES = ("sliding", "hca", "csa")


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, head_dim], keys [L, head_dim] (the values too), visible [T, L] bool, sinks
    [H] -> o [T, H, head_dim]: softmax over the visible keys and the head's sink logit; the
    sink takes probability and gives nothing; a query that sees no key reads zeros. The
    engine's torch ops (engine/ops/v4_attention.py) use this one as their oracle too."""
    scores = torch.einsum("thd,ld->htl", q, keys) * scale  # [H, T, L]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, q.shape[0], 1)  # [H, T, 1]
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)  # [H, T, L]
    return torch.einsum("htl,ld->thd", probs, keys)


def visible_keys(
    ring: torch.Tensor,
    cache: torch.Tensor | None,
    position: int,
    slot: int,
    block_table: torch.Tensor | None,
    window: int,
    ratio: int,
    mode: str,
    sel: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query's keys [L, head_dim]: its window in position order, then its entries (in
    index order for HCA, in the selection's order for CSA)."""
    past = torch.arange(max(0, position - window + 1), position + 1, device=ring.device)
    keys = [ring[slot, past % ring.shape[1]]]
    if mode != "sliding":
        if mode == "hca":
            w = torch.arange((position + 1) // ratio, device=ring.device)
        else:
            w = sel[sel >= 0].long()
        block_size = cache.shape[1] * ratio
        pages = block_table.long()[w * ratio // block_size]
        keys.append(cache[pages, (w * ratio % block_size) // ratio])
    return torch.cat(keys)


def v4_attention_reference(
    q: torch.Tensor,
    ring: torch.Tensor,
    cache: torch.Tensor | None,
    positions: torch.Tensor,
    state_slots: torch.Tensor,
    block_tables: torch.Tensor | None,
    sinks: torch.Tensor,
    *,
    window: int,
    ratio: int,
    mode: str,
    sel: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> o [B, H, head_dim] in q's dtype, the math in float32, scale head_dim^-0.5."""
    assert mode in MODES, f"mode must be one of {MODES}, got {mode!r}"
    assert mode != "csa" or sel is not None, "csa needs the selection sel [B, index_topk]"
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for b, (t, slot) in enumerate(zip(positions.tolist(), state_slots.tolist())):
        keys = visible_keys(
            ring, cache, t, slot, None if block_tables is None else block_tables[b],
            window, ratio, mode, None if sel is None else sel[b],
        ).float()  # fmt: skip
        visible = torch.ones(1, keys.shape[0], dtype=torch.bool, device=q.device)
        o = sink_attention(q[b : b + 1].float(), keys, visible, sinks.float(), scale)
        out[b] = o[0].to(q.dtype)
    return out
