"""Torch twin of kernels/cpu/batch_invariant.py's attention: plain masked softmax attention
in float32, with no care for how its reductions are ordered."""

from __future__ import annotations

import torch


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [S, M, D], k [S, L, D], v [S, L, E], visible [S, M, L] -> [S, M, E] float32."""
    scores = torch.einsum("smd,sld->sml", q.float(), k.float()) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("sml,sle->sme", probs, v.float())
