"""Torch twin of kernels/triton/sampling.py: sort-based filtering, then Gumbel-max.

`filtered_probs_reference` is the distribution the kernel must sample from; with filtering
off, `sample_reference` given the kernel's first-round noise picks the same token."""

from __future__ import annotations

import torch


def filtered_probs_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """[B, V] probabilities after temperature, top-k, top-p and min-p (greedy rows one-hot)."""
    b, v = logits.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = (logits.float() / t[:, None]).softmax(-1)
    p_sorted, idx = probs.sort(-1, descending=True)
    rank = torch.arange(v, device=logits.device)[None, :]
    k = torch.where(top_k <= 0, torch.full_like(top_k, v), top_k)
    keep = rank < k[:, None]
    mass_before = p_sorted.cumsum(-1) - p_sorted
    keep &= mass_before < top_p[:, None]
    keep &= p_sorted >= min_p[:, None] * p_sorted[:, :1]
    kept = torch.zeros_like(probs).scatter(1, idx, p_sorted * keep)
    kept = kept / kept.sum(-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter(1, probs.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, kept)


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """argmax(log filtered probs + Gumbel noise [B, V]) -> [B] int64."""
    probs = filtered_probs_reference(logits, temperature, top_k, top_p, min_p)
    greedy = temperature <= 0
    key = torch.where(probs > 0, probs.log() + noise, torch.full_like(probs, float("-inf")))
    return torch.where(greedy, probs.argmax(-1), key.argmax(-1))
