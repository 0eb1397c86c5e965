"""Verifying draft tokens against the target model, batched over sequences that may have
different numbers of drafts and accept different numbers of them.

Legend: B = sequences, K = drafts per sequence (padded), V = vocabulary.

Every sequence emits its accepted drafts plus one more token: the target's correction at
the first rejected position, or a bonus token from the target's distribution after the
last draft when all were accepted. So a step emits 1..K+1 tokens per sequence.

- greedy: accept while the draft equals the target's argmax (exact: the output equals
  greedy decoding without drafts).
- sampled: accept draft x with probability min(1, p(x) / q(x)); at the first rejection,
  sample from the residual norm(max(p - q, 0)). The emitted tokens are distributed exactly
  as sampling from the target p (Leviathan et al. 2023; Chen et al. 2023). p must be the
  target's final sampling distribution (after temperature / top-k / top-p), q the
  distribution the draft was actually drawn from (one-hot for greedy drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AcceptanceResult:
    tokens: list[list[int]]  # per sequence: accepted drafts, then the correction / bonus token
    num_accepted: torch.Tensor  # [B] int64, drafts accepted (0..num_drafts[b])
    histogram: torch.Tensor  # [K+1] int64: how many sequences accepted 0, 1, ..., K drafts


def _valid_mask(draft_tokens: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    B, K = draft_tokens.shape
    if num_drafts is None:
        return torch.ones(B, K, dtype=torch.bool, device=draft_tokens.device)
    return torch.arange(K, device=draft_tokens.device)[None, :] < num_drafts[:, None]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] number of leading True values."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _result(draft_tokens, num_accepted, final_tokens, K) -> AcceptanceResult:
    drafts, n, final = draft_tokens.tolist(), num_accepted.tolist(), final_tokens.tolist()
    tokens = [drafts[b][: n[b]] + [final[b]] for b in range(len(n))]
    histogram = torch.bincount(num_accepted.cpu(), minlength=K + 1)
    return AcceptanceResult(tokens, num_accepted, histogram)


def greedy_accept(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    num_drafts: torch.Tensor | None = None,
) -> AcceptanceResult:
    """draft_tokens [B, K], target_logits [B, K+1, V] (row i scores the token after draft
    i-1; row 0 follows the last verified token), num_drafts [B] (None: all K)."""
    B, K = draft_tokens.shape
    target = target_logits.argmax(dim=-1)  # [B, K+1]
    match = (draft_tokens == target[:, :K]) & _valid_mask(draft_tokens, num_drafts)
    n = _leading_true(match)
    final = target.gather(1, n[:, None])[:, 0]
    return _result(draft_tokens, n, final, K)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_drafts: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> AcceptanceResult:
    """draft_tokens [B, K] drawn from draft_probs [B, K, V]; target_probs [B, K+1, V]."""
    B, K = draft_tokens.shape
    p = target_probs.float()
    q = draft_probs.float()
    idx = draft_tokens[..., None]
    p_x = p[:, :K].gather(-1, idx)[..., 0]  # [B, K]
    q_x = q.gather(-1, idx)[..., 0]
    u = torch.rand(B, K, generator=generator, device=p.device)
    accept = (u * q_x < p_x) & _valid_mask(draft_tokens, num_drafts)  # u < p/q without dividing
    n = _leading_true(accept)
    # Where to draw the last token from: the residual at the first rejection, or the
    # target's distribution after the last draft when every draft was accepted.
    limit = torch.full_like(n, K) if num_drafts is None else num_drafts.to(n)
    rejected = n < limit
    row = p.gather(1, n[:, None, None].expand(B, 1, p.shape[-1]))[:, 0]  # [B, V] p at n
    q_row = q.gather(1, n.clamp(max=K - 1)[:, None, None].expand(B, 1, q.shape[-1]))[:, 0]
    residual = (row - q_row).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q at a rejected position has probability zero; fall back to p for safety.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), row)
    final_dist = torch.where(rejected[:, None], residual, row)
    final = torch.multinomial(final_dist, 1, generator=generator)[:, 0]
    return _result(draft_tokens, n, final, K)


@dataclass
class AcceptanceStats:
    """Accumulates the accepted-length histogram over steps (for reports and benchmarks)."""

    histogram: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def update(self, result: AcceptanceResult) -> None:
        h = result.histogram.to(torch.int64)
        if h.numel() > self.histogram.numel():
            h, self.histogram = self.histogram, h.clone()
        self.histogram[: h.numel()] += h

    @property
    def steps(self) -> int:
        return int(self.histogram.sum())

    def mean_accepted(self) -> float:
        """Mean drafts accepted per sequence-step; tokens per step is this plus one."""
        if self.steps == 0:
            return 0.0
        lengths = torch.arange(self.histogram.numel(), dtype=torch.float64)
        return float((self.histogram.double() * lengths).sum() / self.steps)

    def summary(self) -> dict:
        return {
            "histogram": self.histogram.tolist(),
            "sequence_steps": self.steps,
            "mean_accepted_drafts": self.mean_accepted(),
            "mean_tokens_per_step": self.mean_accepted() + 1.0,
        }
