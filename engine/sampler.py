"""Turn logits into next tokens: greedy, or temperature / top-k / top-p / min-p sampling
keyed by (the sequence's sample seed, its output position).

One sampler for every step: a sampled token is argmax(log p + g) over the filtered
distribution p (Gumbel-max), with the Gumbel noise g a pure function of (seed, position).
A row's token therefore depends only on its own logits, seed and position: not on the
batch it ran in, on its neighbours' parameters, on a preemption or on a resume. On CUDA the
Triton sampler (kernels/triton/sampling.py) draws the noise with Philox, in eager steps
and inside CUDA graphs alike; on the CPU it comes from a generator seeded by the pair.

Before sampling, `sample_step` applies each row's presence/frequency penalties (over its
own output tokens), its grammar's token bitmask (engine/structured_output/) and its token
ban; all elementwise on the row, so they keep a row independent of its batch. Logprobs are
read from the raw logits (temperature 1, before any of those), each row on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class SampledLogprobs:
    """The raw log-probability of a sampled token and the row's k most likely tokens with
    theirs, most likely first (ties: lower id first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def apply_penalties(
    logits: torch.Tensor, output_tokens: list[int], presence: float, frequency: float
) -> torch.Tensor:
    """logits [V] - presence * (count > 0) - frequency * count, with count the number of
    times each token occurs in `output_tokens` (OpenAI's penalties). A new tensor."""
    vocab = logits.shape[-1]
    ids = torch.tensor([t for t in output_tokens if 0 <= t < vocab], dtype=torch.long)
    counts = torch.bincount(ids, minlength=vocab).to(logits.device, torch.float32)
    return logits.float() - presence * (counts > 0).float() - frequency * counts


def prepare_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_tokens: list[list[int]] | None = None,
    bitmask: torch.Tensor | None = None,
    constrained: list[bool] | None = None,
    banned: list[list[int]] | None = None,
) -> torch.Tensor:
    """logits [N, V] after each row's penalties, grammar mask (bitmask [N, ceil(V/32)]
    int32 on constrained rows) and token ban; `logits` itself when none applies."""
    penalized = [i for i, p in enumerate(params) if p.penalized]
    masked = bitmask is not None and constrained is not None and any(constrained)
    if not (penalized or masked or (banned and any(banned))):
        return logits
    logits = logits.float().clone()
    for i in penalized:
        p = params[i]
        logits[i] = apply_penalties(
            logits[i], output_tokens[i], p.presence_penalty, p.frequency_penalty
        )
    if masked:
        flags = torch.tensor(constrained, dtype=torch.int32, device=logits.device)
        if logits.is_cuda:
            from kernels.triton.token_mask import apply_token_bitmask

            apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), flags)
        else:
            from kernels.reference.token_mask import apply_token_bitmask_reference

            logits = apply_token_bitmask_reference(logits, bitmask, flags.bool())
    for i, ids in enumerate(banned or []):
        if ids:
            logits[i, ids] = float("-inf")
    return logits


def sample_step(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    *,
    output_tokens: list[list[int]] | None = None,
    bitmask: torch.Tensor | None = None,
    constrained: list[bool] | None = None,
    banned: list[list[int]] | None = None,
) -> tuple[list[int], list[SampledLogprobs | None]]:
    """logits [N, V] -> (one token per row, its logprobs where the row asks for them).
    `output_tokens[i]`: row i's generated tokens (its penalties count them)."""
    processed = prepare_logits(logits, params, output_tokens, bitmask, constrained, banned)
    wanted = [p.logprobs for p in params]
    if logits.is_cuda:
        tokens = _sample_cuda(processed, params, seeds, positions)
        return _read_back_cuda(logits, tokens, wanted)
    tokens = sample(processed, params, seeds, positions)
    return tokens, token_logprobs(logits, tokens, wanted)


def token_logprobs(
    raw_logits: torch.Tensor, tokens: list[int], top_k: list[int | None]
) -> list[SampledLogprobs | None]:
    """Per row with top_k[i] not None: log_softmax of its raw logits (float32) at its token,
    and its top_k[i] best. Row by row, so a row's numbers do not depend on its batch."""
    out: list[SampledLogprobs | None] = []
    for i, k in enumerate(top_k):
        if k is None:
            out.append(None)
            continue
        logprobs = torch.log_softmax(raw_logits[i].float(), dim=-1)  # [V]
        top = _top(logprobs, k)
        out.append(SampledLogprobs(float(logprobs[tokens[i]]), *top))
    return out


def _top(logprobs: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k largest entries of logprobs [V], ties to the lower id (a stable descending
    sort; topk's tie order is unspecified)."""
    if k == 0:
        return [], []
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    kth = values[-1]
    # every entry tied with the k-th, so the stable sort picks the lowest ids among them
    candidates = torch.nonzero(logprobs >= kth).flatten()
    order = torch.sort(logprobs[candidates], descending=True, stable=True).indices[:k]
    chosen = candidates[order]
    return chosen.tolist(), logprobs[chosen].tolist()


def _read_back_cuda(raw_logits, tokens: torch.Tensor, top_k: list[int | None]):
    """Tokens [N] on the device -> (token list, logprobs) in one device-to-host copy."""
    rows = [i for i, k in enumerate(top_k) if k is not None]
    if not rows:
        return tokens.tolist(), [None] * len(top_k)
    k_max = max(top_k[i] for i in rows)
    index = torch.tensor(rows, device=raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[index].float(), dim=-1)  # [R, V]
    chosen = logprobs.gather(1, tokens[index][:, None])  # [R, 1]
    top_values, top_ids = torch.topk(logprobs, k_max, dim=-1)  # [R, K]
    # one float64 block, the tokens first (ids are exact in float64): one copy, one wait
    packed = torch.cat([chosen.double(), top_values.double(), top_ids.double()], dim=1)
    block = torch.cat([tokens.double(), packed.flatten()]).cpu().tolist()
    n, width = len(top_k), 1 + 2 * k_max
    out: list[SampledLogprobs | None] = [None] * n
    for r, i in enumerate(rows):
        k = top_k[i]
        line = block[n + r * width : n + (r + 1) * width]
        ids = [int(x) for x in line[1 + k_max : 1 + k_max + k]]
        out[i] = SampledLogprobs(line[0], ids, line[1 : 1 + k])
    return [int(t) for t in block[:n]], out


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
        return _sample_cuda(logits, params, seeds, positions).tolist()
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


def _sample_cuda(logits, params, seeds, positions) -> torch.Tensor:
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
    return tokens
