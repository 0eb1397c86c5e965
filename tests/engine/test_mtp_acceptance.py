"""Greedy and rejection-sampling acceptance of draft tokens (pure tensor functions)."""

import torch

from engine.spec_decode.acceptance import (
    AcceptanceStats,
    greedy_accept,
    rejection_sample,
)


def logits_for(tokens, V=6):
    """[B, K+1, V] logits whose argmax is `tokens`."""
    t = torch.tensor(tokens)
    return torch.nn.functional.one_hot(t, V).float() * 5 + torch.rand(*t.shape, V)


def test_greedy_accept_batched_with_different_lengths():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4], [5, 0, 0]])
    target = logits_for([[1, 2, 3, 5], [1, 0, 3, 5], [2, 4, 4, 1], [5, 3, 0, 0]])
    res = greedy_accept(drafts, target, num_drafts=torch.tensor([3, 3, 3, 1]))
    assert res.num_accepted.tolist() == [3, 1, 0, 1]
    assert res.tokens == [[1, 2, 3, 5], [1, 0], [2], [5, 3]]
    assert res.histogram.tolist() == [1, 2, 0, 1]


def _fixed_distributions(V, K, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(K, V, generator=gen) * 1.5, dim=-1)
    return p, q


def _tv(samples, probs):
    freq = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * float((freq - probs.double()).abs().sum())


def test_rejection_sampling_preserves_the_target_distribution():
    V, K, N = 5, 3, 60_000
    p, q = _fixed_distributions(V, K, seed=0)
    gen = torch.Generator().manual_seed(1)
    drafts = torch.stack(
        [torch.multinomial(q[k], N, replacement=True, generator=gen) for k in range(K)], 1
    )
    res = rejection_sample(drafts, q.expand(N, K, V), p.expand(N, K + 1, V), generator=gen)
    first = torch.tensor([t[0] for t in res.tokens])
    # token 0 ~ p_0; given tokens 0..i-1 were drafts that got accepted, token i ~ p_i
    assert _tv(first, p[0]) < 0.01
    for i in (1, 2, 3):
        emitted = torch.tensor([t[i] for t in res.tokens if len(t) > i])
        assert emitted.numel() > 2000
        assert _tv(emitted, p[i]) < 0.02, i
    # the draft is accepted with probability sum_x min(p, q) at position 0
    rate0 = float((res.num_accepted > 0).double().mean())
    assert abs(rate0 - float(torch.minimum(p[0], q[0]).sum())) < 0.01
    assert res.histogram.sum() == N and res.histogram.numel() == K + 1


def test_rejection_sampling_chi_square_against_target():
    from scipy.stats import chisquare

    V, K, N = 4, 2, 40_000
    p, q = _fixed_distributions(V, K, seed=3)
    gen = torch.Generator().manual_seed(4)
    drafts = torch.stack(
        [torch.multinomial(q[k], N, replacement=True, generator=gen) for k in range(K)], 1
    )
    res = rejection_sample(drafts, q.expand(N, K, V), p.expand(N, K + 1, V), generator=gen)
    counts = torch.bincount(torch.tensor([t[0] for t in res.tokens]), minlength=V).double()
    expected = p[0].double() / p[0].double().sum() * N
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_rejection_sampling_with_identical_draft_accepts_everything():
    V, K, N = 6, 4, 500
    p, _ = _fixed_distributions(V, K, seed=5)
    gen = torch.Generator().manual_seed(6)
    drafts = torch.stack(
        [torch.multinomial(p[k], N, replacement=True, generator=gen) for k in range(K)], 1
    )
    res = rejection_sample(drafts, p[:K].expand(N, K, V), p.expand(N, K + 1, V), generator=gen)
    assert res.num_accepted.tolist() == [K] * N


def test_rejection_sampling_respects_per_sequence_draft_counts():
    V, K = 3, 3
    p = torch.tensor([[0.0, 1.0, 0.0]] * (K + 1)).expand(2, K + 1, V)
    q = torch.tensor([[0.0, 1.0, 0.0]] * K).expand(2, K, V)
    drafts = torch.ones(2, K, dtype=torch.int64)
    res = rejection_sample(drafts, q, p, num_drafts=torch.tensor([1, 3]))
    assert res.num_accepted.tolist() == [1, 3]
    assert res.tokens == [[1, 1], [1, 1, 1, 1]]


def test_stats_accumulate_histograms():
    stats = AcceptanceStats()
    drafts = torch.tensor([[1, 2], [3, 3]])
    stats.update(greedy_accept(drafts, logits_for([[1, 2, 0], [0, 0, 0]])))
    stats.update(greedy_accept(drafts, logits_for([[1, 0, 0], [3, 0, 0]])))
    assert stats.histogram.tolist() == [1, 2, 1]
    assert stats.summary()["mean_accepted_drafts"] == 1.0
