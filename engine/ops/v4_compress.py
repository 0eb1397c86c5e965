"""DeepSeek-V4's KV compressors (HCA, CSA) and the lightning indexer: pure torch functions
over explicit tensors.

Legend: docs/shapes.md (T tokens, P rope dim). Sizes local to this file: m the compress
ratio, W the projection width (d for HCA; 2d for CSA, the two series [Ca | Cb]), d the
entry width (`head_dim`, or `index_head_dim` for the indexer's keys), n entries, Hi the
indexer's heads.

Per token t at position p: kv = wkv(x) [W], score = wgate(x) + ape[p % m] [W] (float32).

- HCA (no overlap): entry w pools the m tokens of window w = [w*m, w*m + m):
  e_w = sum_i softmax_i(score_i) * kv_i, per channel over the window's m slots.
- CSA (overlap, m = 4): entry w pools 2m slots, Ca (kv[:d]) of window w - 1's tokens and
  Cb (kv[d:]) of window w's; window -1's slots are (kv 0, score -inf), weight 0.
- Then e_w = rope(rmsnorm(e_w) * norm, position w*m) on its last P dims (interleaved pairs).

**An entry is committed only when its window's last token (w*m + m - 1) is seen**: a prefix
of T tokens has T // m entries. Pooling is float32 whatever the model's dtype, and every
path (a whole prefix, a chunk after a state, one decode token) lays the same values into
the same [n, slots, d] tensor and pools it with `_pool`, so the entries do not depend on
how a prefix was split into steps (bit for bit).

The pooling state of one sequence is `state [2, reach, W]` float32: row q % reach holds
token q's (kv, score + ape). reach = R + lookahead, R = m (HCA) or 2m (CSA, the previous
window's Ca is still needed); lookahead is 0, or the drafts a speculative step writes past
the last accepted token, so that a rejected draft's row at q never overwrites a row the
next chunk reads (those lie within R before it). A chunk reads the rows of its first open
window (and, for CSA, the window before) from it and writes its own last `reach` tokens
back. At V4-Flash sizes (lookahead 0): HCA 2 * 128 * 512 * 4 B = 512 KiB; CSA compressor
2 * 8 * 1024 * 4 B = 64 KiB; CSA indexer 2 * 8 * 256 * 4 B = 16 KiB.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.v4_attention import apply_rope, rope_cos_sin
from kernels.cpu import batch_invariant


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 RMSNorm times a float32 weight, cast back to x's dtype (transformers'
    DeepseekV4RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def state_rows(ratio: int, overlap: bool, lookahead: int = 0) -> int:
    """The tokens a sequence's pooling state keeps: R (one window, two with overlap) plus
    `lookahead` (speculative drafts, module docstring)."""
    return (2 * ratio if overlap else ratio) + lookahead


def new_state(ratio: int, width: int, overlap: bool, device=None) -> torch.Tensor:
    """An empty pooling state [2, R, W] float32 (its rows are read only once written)."""
    return torch.zeros(2, state_rows(ratio, overlap), width, dtype=torch.float32, device=device)


def token_rows(
    kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """kv, score [T, W] (the projections) at positions [T] -> rows [2, T, W] float32:
    (kv, score + ape[p % m]), what the pooling reads and the state stores."""
    ratio = ape.shape[0]
    biased = score.float() + ape.float()[positions % ratio]
    return torch.stack((kv.float(), biased))


def _slots(rows: torch.Tensor, ratio: int, overlap: bool, prior: torch.Tensor | None):
    """rows [2, n*m, W] of n whole windows -> (kv, score) [n, S, d], S = m or 2m. With
    overlap, `prior` [2, m, W] is the rows of the window before the first (None: the first
    window is window 0, whose Ca slots get kv 0 and score -inf)."""
    n = rows.shape[1] // ratio
    win = rows.view(2, n, ratio, -1)
    if not overlap:
        return win[0], win[1]
    d = win.shape[-1] // 2
    kv = win.new_zeros(n, 2 * ratio, d)
    score = win.new_full((n, 2 * ratio, d), float("-inf"))
    kv[:, ratio:], score[:, ratio:] = win[0, ..., d:], win[1, ..., d:]
    kv[1:, :ratio], score[1:, :ratio] = win[0, :-1, :, :d], win[1, :-1, :, :d]
    if prior is not None:
        kv[0, :ratio], score[0, :ratio] = prior[0, :, :d], prior[1, :, :d]
    return kv, score


def _pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    first: int,
    ratio: int,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """kv, score [n, S, d] float32 of entries first.. -> entries [n, d] in dtype.

    The softmax over the slots is spelled out: torch.softmax over a non-last dim rounds
    differently with n (the kernel's blocking), which would make an entry depend on how
    many entries it was computed with; amax, exp and sum over dim 1 do not."""
    weights = torch.exp(score - score.amax(dim=1, keepdim=True))
    pooled = (kv * (weights / weights.sum(dim=1, keepdim=True))).sum(dim=1)
    entries = rms_norm(pooled, norm_weight, eps)
    positions = (torch.arange(kv.shape[0], device=kv.device) + first) * ratio
    cos, sin = rope_cos_sin(positions, inv_freq)
    return apply_rope(entries, cos, sin).to(dtype)


def compress_prefix(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    overlap: bool,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """A prefix's projections kv, score [T, W] (positions 0..T-1; ape [m, W]) -> its
    committed entries [T // m, d] in kv's dtype."""
    ratio = ape.shape[0]
    n = kv.shape[0] // ratio
    positions = torch.arange(n * ratio, device=kv.device)
    rows = token_rows(kv[: n * ratio], score[: n * ratio], ape, positions)
    slot_kv, slot_score = _slots(rows, ratio, overlap, None)
    return _pool(slot_kv, slot_score, 0, ratio, norm_weight, eps, inv_freq, kv.dtype)


def compress_chunk(
    kv: torch.Tensor,
    score: torch.Tensor,
    start: int,
    state: torch.Tensor,
    ape: torch.Tensor,
    overlap: bool,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """The next T tokens of a sequence, positions start..start+T-1 (kv, score [T, W]), after
    its pooling state [2, reach, W] holding tokens < start (reach >= R, module docstring)
    -> (the entries their windows commit [n_new, d] in kv's dtype, the index of the first
    of them). Writes the chunk's last `reach` tokens into `state` in place; a decode step
    is the chunk T = 1."""
    ratio = ape.shape[0]
    reach, need = state.shape[1], state_rows(ratio, overlap)
    if reach < need:
        raise ValueError(f"a pooling state of {reach} rows; this compressor needs >= {need}")
    t = kv.shape[0]
    positions = torch.arange(start, start + t, device=kv.device)
    rows = token_rows(kv, score, ape, positions)
    first, end = start // ratio, (start + t) // ratio  # windows [first, end) close here
    lead = ratio if overlap and first > 0 else 0
    h0 = first * ratio - lead  # earliest token read: the previous window's start, if needed
    if end > first:
        past = torch.arange(h0, start, device=kv.device) % reach
        hist = torch.cat([state[:, past], rows], dim=1)
        prior = hist[:, :ratio] if lead else None
        body = hist[:, lead : lead + (end - first) * ratio]
        slot_kv, slot_score = _slots(body, ratio, overlap, prior)
        entries = _pool(slot_kv, slot_score, first, ratio, norm_weight, eps, inv_freq, kv.dtype)
    else:
        entries = kv.new_zeros(0, kv.shape[1] // 2 if overlap else kv.shape[1])
    keep = min(t, reach)
    state[:, positions[t - keep :] % reach] = rows[:, t - keep :]
    return entries, first


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q [T, Hi, d] (roped), keys [n, d] (the indexer's compressed keys), weights [T, Hi]
    (weights_proj(x)) -> scores [T, n] float32:
    sum_h weights_h * Hi^-0.5 * ReLU(q_h . k) * d^-0.5."""
    heads, dim = q.shape[1], q.shape[2]
    flat = q.float().reshape(-1, dim)  # [T * Hi, d]: each row's dots as if alone
    dots = batch_invariant.linear(flat, keys.float()).view(q.shape[0], heads, -1)
    dots = F.relu(dots) * dim**-0.5
    w = weights.float() * heads**-0.5
    return (dots * w[..., None]).sum(dim=1)


def indexer_topk(
    scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int
) -> torch.Tensor:
    """scores [T, n], positions [T] -> indices [T, min(topk, n)] int64 of each query's
    best committed entries (w < (p + 1) // m), -1 where a query has fewer than that many.
    Equal scores (ReLU makes many exactly 0) may be chosen in any order: compare
    selections by their scores, not their indices."""
    n = scores.shape[1]
    k = min(topk, n)
    if n == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.int64, device=scores.device)
    limit = ((positions + 1) // ratio)[:, None]
    future = torch.arange(n, device=scores.device)[None, :] >= limit
    picked = scores.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
    return torch.where(picked >= limit, torch.full_like(picked, -1), picked)
