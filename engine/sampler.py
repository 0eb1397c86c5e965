"""Turn logits into next tokens: greedy, or temperature / top-k / top-p / min-p sampling
keyed by (the sequence's sample seed, its output position).

One sampler for every step: a sampled token is argmax(log p + g) over the filtered
distribution p (Gumbel-max), with the Gumbel noise g a pure function of (seed, position).
A row's token therefore depends only on its own logits, seed and position: not on the
batch it ran in, on its neighbours' parameters, on a preemption or on a resume. On CUDA the
Triton sampler (kernels/triton/sampling.py) draws the noise with Philox, in eager steps
and inside CUDA graphs alike; on the CPU it comes from a generator seeded by the pair.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

_MASK63 = (1 << 63) - 1


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


def noise_key(seed: int, position: int) -> int:
    """The CPU generator's seed for one (sample seed, output position) pair."""
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK63
    mixed ^= mixed >> 31
    return (mixed * 0x94D049BB133111EB) & _MASK63


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [vocab] float32 for one (seed, position): the same on every call."""
    generator = torch.Generator().manual_seed(noise_key(seed, position))
    u = torch.rand(vocab, generator=generator)
    return -torch.log(-torch.log(u))  # u = 0 gives -inf: never drawn


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    banned: list[list[int]] | None = None,
) -> list[int]:
    """logits [N, V] -> one token per row. Row i samples with seed `seeds[i]` (ignored by
    greedy rows) at output position `positions[i]`; `banned[i]` are token ids it may not
    pick (its EOS/stop ids while min_tokens is not reached)."""
    if banned and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, ids] = float("-inf")
    if logits.is_cuda:
        return _sample_cuda(logits, params, seeds, positions)
    out: list[int] = []
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if p.greedy:
            out.append(int(logits[i].argmax()))
            continue
        probs = filter_logits(logits[i], p)
        key = torch.where(
            probs > 0, probs.log() + gumbel_noise(seeds[i], positions[i], vocab), float("-inf")
        )
        out.append(int(key.argmax()))
    return out


def _sample_cuda(logits, params, seeds, positions) -> list[int]:
    from kernels.triton.sampling import sample as triton_sample

    device = logits.device

    def column(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    tokens = triton_sample(
        logits.float().contiguous(),
        column([0.0 if p.greedy else p.temperature for p in params], torch.float32),
        column([p.top_k for p in params], torch.int32),
        column([p.top_p for p in params], torch.float32),
        column([p.min_p for p in params], torch.float32),
        column(seeds, torch.int64),
        column(positions, torch.int64),
    )
    return tokens.tolist()
