"""Torch twin of kernels/triton/token_mask.py: a grammar's token bitmask applied to logits.

Legend: N = rows, V = vocabulary, W = ceil(V / 32) mask words per row.
Bit v % 32 of word v // 32 is set when token v is allowed (xgrammar's layout)."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [N, W] int32 -> allowed [N, V] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32)[:, :, None] >> shifts) & 1  # [N, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, constrained: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [N, V] with -inf where a constrained row's bit is clear (a new tensor).
    `constrained` [N] bool (None: every row); rows without it are left as they are."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])  # [N, V]
    if constrained is not None:
        allowed = allowed | ~constrained.bool()[:, None]
    return logits.masked_fill(~allowed, float("-inf"))
