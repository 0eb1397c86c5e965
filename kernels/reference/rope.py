"""Torch twin of kernels/triton/rope.py (out of place)."""

from __future__ import annotations

import torch


def rope_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """x [T, H, P] (P the rope dim, docs/shapes.md) -> rotated copy in x's dtype; cos, sin
    [max_pos, P/2]."""
    c = cos[positions.long()][:, None, :]  # [T, 1, P/2]
    s = sin[positions.long()][:, None, :]
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
    else:
        a, b = xf.chunk(2, dim=-1)
    ra, rb = a * c - b * s, a * s + b * c
    out = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)
    return out.to(x.dtype)
