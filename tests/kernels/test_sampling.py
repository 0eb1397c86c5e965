import pytest
import torch

from kernels.reference.sampling import filtered_probs_reference, sample_reference
from kernels.triton.sampling import gumbel_noise, sample
from tests.kernels._helpers import DEVICE, gpu_only


def params(b, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed0=0):
    f = lambda val, dt: torch.full((b,), val, dtype=dt, device=DEVICE)  # noqa: E731
    return dict(
        temperature=f(temperature, torch.float32), top_k=f(top_k, torch.int32),
        top_p=f(top_p, torch.float32), min_p=f(min_p, torch.float32),
        seed=torch.arange(seed0, seed0 + b, device=DEVICE), step=f(3, torch.int64),
    )  # fmt: skip


def _logits(b, v, seed):
    return (2 * torch.randn(b, v, generator=torch.Generator().manual_seed(seed))).to(DEVICE)


def test_greedy_and_top_k_one_are_argmax():
    logits = _logits(6, 50, 0)
    assert torch.equal(sample(logits, **params(6, temperature=0.0)), logits.argmax(-1))
    assert torch.equal(sample(logits, **params(6, top_k=1)), logits.argmax(-1))


def test_unfiltered_matches_reference_with_the_same_noise():
    logits = _logits(5, 40, 1)
    p = params(5, temperature=0.7)
    noise = gumbel_noise(p["seed"], p["step"], 40)
    ref = sample_reference(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], noise)
    assert torch.equal(sample(logits, **p, block_v=16), ref)


def test_same_seed_same_token_other_step_other_draw():
    logits = _logits(1, 64, 2).expand(16, 64).contiguous()
    p = params(16)
    p["seed"] = torch.full((16,), 7, device=DEVICE)
    same = sample(logits, **p)
    assert (same == same[0]).all()  # identical rows, seeds and steps: identical tokens
    p["step"] = torch.arange(16, device=DEVICE)
    assert len(set(sample(logits, **p).tolist())) > 1


@pytest.mark.parametrize(
    "kw", [dict(top_k=3, min_p=0.05), dict(top_k=5, top_p=0.7, temperature=1.5)]
)
def test_filtered_sampling_follows_the_filtered_distribution(kw):
    v, n = 8, 256
    logits = _logits(1, v, 5).expand(n, v).contiguous()
    p = params(n, **kw, seed0=1000)
    counts = torch.bincount(sample(logits, **p).cpu(), minlength=v).double() / n
    probs = filtered_probs_reference(
        logits[:1], *(p[k][:1] for k in ("temperature", "top_k", "top_p", "min_p"))
    )
    probs = probs[0].cpu().double()
    assert (counts[probs == 0] == 0).all(), "sampled a token the filters exclude"
    assert 0.5 * (counts - probs).abs().sum() < 0.15  # total variation; n=256 gives ~0.06 noise


@pytest.mark.gpu
@gpu_only
def test_sampling_gpu_vocab_distribution():
    v, n = 129280, 4096
    logits = _logits(1, v, 9)
    logits[0, :4] += 12.0  # a realistic peaked head
    logits = logits.expand(n, v).contiguous()
    p = params(n, top_k=50, top_p=0.9, temperature=0.8)
    got = torch.bincount(sample(logits, **p), minlength=v).double() / n
    probs = filtered_probs_reference(
        logits[:1], *(p[k][:1] for k in ("temperature", "top_k", "top_p", "min_p"))
    )[0].double()
    assert (got[probs == 0] == 0).all()
    assert 0.5 * (got - probs).abs().sum() < 0.05


def test_split_first_pass_keeps_the_lowest_index_of_a_tie():
    # v = 64 in blocks of 16: the first pass splits over 4 programs per row; the max sits
    # in splits 1 and 3 (row 0), twice inside split 2 (row 1), at the last entry (row 2)
    logits = _logits(3, 64, 6)
    logits[0, [20, 50]] = 9.0
    logits[1, [33, 40]] = 9.0
    logits[2, 63] = 9.0
    got = sample(logits, **params(3, temperature=0.0), block_v=16)
    assert got.tolist() == [20, 33, 63] == logits.argmax(-1).tolist()


def test_split_first_pass_with_a_split_of_only_minus_infinity():
    # a split whose logits are all -inf contributes nothing (no NaN in the normaliser):
    # unfiltered draws equal the reference's with the same noise, and top-p draws (which
    # need the true normaliser) equal those of one program per row (block_v = 64)
    logits = _logits(4, 48, 7)
    logits[:, 16:32] = float("-inf")
    p = params(4, temperature=0.9)
    noise = gumbel_noise(p["seed"], p["step"], 48)
    ref = sample_reference(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], noise)
    assert torch.equal(sample(logits, **p, block_v=16), ref)
    p = params(4, temperature=0.9, top_p=0.8)
    assert torch.equal(sample(logits, **p, block_v=16), sample(logits, **p, block_v=64))
    greedy = sample(logits, **params(4, temperature=0.0), block_v=16)
    assert torch.equal(greedy, logits.argmax(-1))
