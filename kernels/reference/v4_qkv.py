"""Torch twin of kernels/triton/v4_qkv.py: the same rounding points, spelled as plain torch
ops (the engine's functions in engine/ops/v4_attention.py compute the same numbers; the
kernels' tests compare against both)."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float):
    """x [B, ..., head_dim] -> a copy with its last 2 * len(inv_freq) dims rotated
    pairwise (2j, 2j + 1) by sign * pos * inv_freq[j], in float32, back in x's dtype."""
    half = inv_freq.shape[0]
    angle = positions.float()[:, None] * inv_freq.float()[None, :]  # [B, P/2]
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = angle.cos().view(view), sign * angle.sin().view(view)
    rope = x[..., x.shape[-1] - 2 * half :].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    out = x.clone()
    out[..., x.shape[-1] - 2 * half :: 2] = (a * cos - b * sin).to(x.dtype)
    out[..., x.shape[-1] - 2 * half + 1 :: 2] = (b * cos + a * sin).to(x.dtype)
    return out


def v4_q_prologue_reference(x, positions, inv_freq, eps: float, n_heads: int) -> torch.Tensor:
    """x [B, H * head_dim] -> q [B, H, head_dim]: unit RMS per head (scale rounded to x's
    dtype before the product), then the rope."""
    q = x.view(x.shape[0], n_heads, -1)
    scale = torch.rsqrt(q.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    return _rotate(q * scale, positions, inv_freq, 1.0)


def v4_kv_prologue_reference(x, weight, eps: float, positions, inv_freq, ring, slots):
    """x [B, head_dim] -> kv [B, head_dim]: x * rstd * weight in float32, rounded, then
    the rope; written into ring [slots, ring_size, head_dim] at [slot, pos % ring_size]."""
    h = x.float()
    normed = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * weight.float()
    kv = _rotate(normed.to(x.dtype), positions, inv_freq, 1.0)
    ring[slots.long(), positions.long() % ring.shape[1]] = kv.to(ring.dtype)
    return kv


def v4_o_epilogue_reference(o, positions, inv_freq, wo_a) -> torch.Tensor:
    """o [B, H, head_dim] -> [B, o_groups * o_lora_rank]: de-rotate at -pos, then group g
    (heads g * H / o_groups ..., flattened) times its rows of wo_a, a loop over groups."""
    rows, width = o.shape[0], wo_a.shape[1]
    flat = _rotate(o, positions, inv_freq, -1.0).reshape(rows, -1)
    groups = flat.shape[1] // width
    rank = wo_a.shape[0] // groups
    parts = [
        flat[:, g * width : (g + 1) * width] @ wo_a[g * rank : (g + 1) * rank].T
        for g in range(groups)
    ]
    return torch.cat(parts, dim=1)
