"""DeepSeek-V4's attention arithmetic for a sliding-window layer (compress ratio 0), as pure
torch functions over explicit tensors, the oracle a paged window ring and its kernels are
tested against.

Legend: docs/shapes.md (T tokens, L keys the queries may see, H heads, D hidden, P the rope
dims at the end of each head, `qk_rope_head_dim`); sizes without a letter are spelled as
their config keys: `head_dim` (512 in V4-Flash), `o_groups` (8), `o_lora_rank` (1024).

    qr  = q_norm(wq_a(x))                                   [T, q_lora_rank]
    q   = rope(unit_rms(wq_b(qr).view(T, H, head_dim)), pos)    per-head RMS, no weight
    kv  = rope(kv_norm(wkv(x)), pos)                   [T, head_dim]: one MQA head, K = V
    o_h = sum_l p_hl kv_l    p = softmax({q_h.kv_l / sqrt(head_dim) | l in window}, sink_h)
    o   = rope(o, -pos)                                     de-rotation at the query
    out = wo_b(concat_g(o_g @ wo_a[g]^T))                   o_g: heads of group g

The rope is interleaved (pairs 2i, 2i+1) on the last P dims of a head. A key is visible to
the query at position t when t - window < pos <= t: the window counts the query itself.
The sink is a per-head logit in the softmax's denominator with no value, so a row's
probabilities sum to less than 1. The value the query reads carries the key's rotation;
de-rotating the output at the query position leaves each key's contribution a function of
the distance only. Every product here runs in the inputs' dtype; the rope and the
normalisations compute in float32 and cast back, as transformers does.
"""

from __future__ import annotations

import torch

from kernels.cpu import batch_invariant
from kernels.reference.v4_attention import sink_attention

# sink_attention(q [T, H, head_dim], keys [L, head_dim] (the values too), visible [T, L],
# sinks [H], scale) -> o [T, H, head_dim]: the decode kernel's twin is the oracle here too.
__all__ = ["apply_rope", "grouped_low_rank", "rope_cos_sin", "sink_attention", "unit_rms",
           "window_mask"]  # fmt: skip


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """positions [T] -> (cos, sin) [T, P/2] float32, one angle per interleaved pair. V4's
    compressed layers use YaRN frequencies without its attention factor, so there is none."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return batch_invariant.lanes(torch.cos, freqs), batch_invariant.lanes(torch.sin, freqs)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., head_dim] with cos/sin [T, P/2] -> x with its last P dims rotated pairwise:
    (a, b) -> (a cos - b sin, b cos + a sin), in float32, cast back to x's dtype. Pass -sin
    to rotate back."""
    half = cos.shape[-1]
    view = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.reshape(view), sin.reshape(view)
    nope, rope = x[..., : -2 * half], x[..., -2 * half :].float()
    a, b = rope[..., 0::2], rope[..., 1::2]  # [T, ..., P/2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, no weight: the per-head q norm. The
    scale is formed in float32 and cast to x's dtype before the product."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """q_pos [T], k_pos [L] -> [T, L] bool: key l is visible to query t (causal, and within
    the last `window` positions including t's own)."""
    delta = q_pos[:, None] - k_pos[None, :]
    return (delta >= 0) & (delta < window)


def grouped_low_rank(o: torch.Tensor, wo_a: torch.Tensor) -> torch.Tensor:
    """o [T, H, head_dim], wo_a [o_groups * o_lora_rank, H * head_dim / o_groups] ->
    [T, o_groups * o_lora_rank], the input of wo_b. Group g is the heads g * H / o_groups ...
    flattened, projected by its own o_lora_rank rows of wo_a: a block-diagonal product, so
    o_groups is read from the shapes."""
    T = o.shape[0]
    x = o.reshape(T, -1, wo_a.shape[1]).transpose(0, 1)  # [o_groups, T, H*head_dim/o_groups]
    w = wo_a.view(x.shape[0], -1, wo_a.shape[1])  # [o_groups, o_lora_rank, same]
    y = batch_invariant.batched_matmul(x, w.transpose(1, 2))  # [o_groups, T, o_lora_rank]
    return y.transpose(0, 1).reshape(T, -1)  # [T, o_groups * o_lora_rank]
