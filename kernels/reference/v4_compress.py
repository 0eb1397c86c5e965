"""Torch twin of kernels/triton/v4_compress.py: DeepSeek-V4's compressor for one decode
token per row, and the indexer's scores over each row's paged keys. It loops over rows
and reads positions back to the host, so it is an oracle, not a decode path; its
arithmetic is engine/ops/v4_compress.py's `_slots` / `_pool` / `indexer_scores`.

Legend: docs/shapes.md (B sequences, one token each; P rope dim). Sizes without a letter:
m the compress ratio (`ape.shape[0]`), W the projection width (d, or 2d with overlap: the
series [Ca | Cb]), d the entry width, reach the pooling state's rows (>= m, or 2m with
overlap; more with a speculative lookahead), Hi the indexer heads, d_i their width.
  kv, score [B, W]                          the token's wkv / wgate projections
  ape [m, W] float32                        added to the score at p % m
  state [slots, 2, reach, W] float32        token q of the sequence in slot s at
                                            state[s, :, q % reach] = (kv, score + ape)
  cache [num_blocks, block_size // m, d]    entry w at cache[block_tables[b, w * m //
                                            block_size], (w * m % block_size) // m]
  positions [B], state_slots [B], block_tables [B, max_blocks] int32
  norm_weight [d] float32, inv_freq [P/2] float32
Entry w pools window w's slots per channel (softmax over the slots, float32): HCA the m
tokens w*m .. w*m + m - 1; CSA (overlap) Ca of window w - 1's tokens then Cb of window
w's, window -1's slots kv 0 and score -inf; then RMSNorm times norm_weight, then rope on
the last P dims (interleaved pairs) at position w * m, cast to the cache's dtype.
"""

from __future__ import annotations

import torch


def entry_row(block_table: torch.Tensor, w: int, ratio: int, block_size: int) -> tuple:
    """(block, row) of entry w in a paged compressed cache."""
    return int(block_table[w * ratio // block_size]), (w * ratio % block_size) // ratio


def pool_window(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor,
                inv_freq: torch.Tensor, position: int, eps: float) -> torch.Tensor:  # fmt: skip
    """kv, score [S, d] float32 of one window's slots -> its entry [d] float32."""
    weights = torch.exp(score - score.amax(dim=0, keepdim=True))
    pooled = (kv * (weights / weights.sum(dim=0, keepdim=True))).sum(dim=0)
    entry = norm_weight.float() * (pooled * torch.rsqrt(pooled.square().mean() + eps))
    half = inv_freq.shape[0]
    angle = torch.tensor(float(position), device=kv.device) * inv_freq.float()
    cos, sin = torch.cos(angle), torch.sin(angle)
    rope = entry[entry.shape[0] - 2 * half :]
    a, b = rope[0::2], rope[1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten()
    return torch.cat([entry[: entry.shape[0] - 2 * half], rotated])


def compress_decode_reference(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    state: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    state_slots: torch.Tensor,
    block_tables: torch.Tensor,
    norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    overlap: bool,
) -> None:
    """In place: each row's (kv, score + ape[p % m]) into its state row p % reach, and the
    entry of each window a row's token closes (p % m == m - 1) into the cache."""
    ratio, reach = ape.shape[0], state.shape[2]
    d = kv.shape[1] // 2 if overlap else kv.shape[1]
    block_size = cache.shape[1] * ratio
    for b, (p, slot) in enumerate(zip(positions.tolist(), state_slots.tolist())):
        state[slot, 0, p % reach] = kv[b].float()
        state[slot, 1, p % reach] = score[b].float() + ape[p % ratio].float()
        if p % ratio != ratio - 1:
            continue
        start = p - ratio + 1
        tokens = torch.arange(start, start + ratio)
        slot_kv, slot_score = state[slot, 0, tokens % reach], state[slot, 1, tokens % reach]
        if overlap:
            prev_kv = state[slot, 0, (tokens - ratio) % reach, :d]
            prev_score = state[slot, 1, (tokens - ratio) % reach, :d]
            if start == 0:  # window -1: kv 0, score -inf
                prev_kv = torch.zeros_like(prev_kv)
                prev_score = torch.full_like(prev_score, float("-inf"))
            slot_kv = torch.cat([prev_kv, slot_kv[:, d:]])
            slot_score = torch.cat([prev_score, slot_score[:, d:]])
        entry = pool_window(slot_kv, slot_score, norm_weight, inv_freq, start, eps)
        page, row = entry_row(block_tables[b], start // ratio, ratio, block_size)
        cache[page, row] = entry.to(cache.dtype)


def indexer_scores_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    ratio: int,
) -> torch.Tensor:
    """q [B, Hi, d_i], weights [B, Hi], keys [num_blocks, block_size // m, d_i] -> scores
    [B, n] float32, n = max_blocks * block_size // m: sum_h w_h Hi^-0.5 ReLU(q_h . k_s)
    d_i^-0.5 over each row's committed entries s < (p + 1) // m, -inf past them."""
    heads, dim = q.shape[1], q.shape[2]
    block_size = keys.shape[1] * ratio
    n = block_tables.shape[1] * keys.shape[1]
    scores = torch.full((q.shape[0], n), float("-inf"), device=q.device)
    for b, p in enumerate(positions.tolist()):
        committed = (p + 1) // ratio
        if committed == 0:
            continue
        rows = [entry_row(block_tables[b], w, ratio, block_size) for w in range(committed)]
        k = torch.stack([keys[page, row] for page, row in rows]).float()  # [n_b, d_i]
        dots = torch.relu(q[b].float() @ k.T) * dim**-0.5  # [Hi, n_b]
        w = weights[b].float() * heads**-0.5
        scores[b, :committed] = (dots * w[:, None]).sum(dim=0)
    return scores
