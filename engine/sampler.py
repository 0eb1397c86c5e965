"""Turn logits into next tokens: greedy, or temperature / top-k / top-p / min-p sampling
with a per-sequence generator, so a seeded request samples the same tokens whatever else
is in the batch."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k, top-p and min-p (float32)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        drop_sorted = (cum - sorted_probs) >= params.top_p * cum[-1]
        probs = probs.masked_fill(drop_sorted.scatter(0, order, drop_sorted), 0.0)
    return probs / probs.sum()


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]] | None = None,
) -> list[int]:
    """logits [N, V] -> one token per row. `banned[i]` are token ids row i may not pick
    (the EOS/stop ids while min_tokens is not reached)."""
    out: list[int] = []
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if banned:
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, ids] = float("-inf")
    if greedy_rows:
        greedy_tokens = logits[greedy_rows].argmax(-1).tolist()
    greedy_iter = iter(greedy_tokens) if greedy_rows else iter(())
    for i, p in enumerate(params):
        if p.greedy:
            out.append(next(greedy_iter))
            continue
        probs = filter_logits(logits[i], p)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out
