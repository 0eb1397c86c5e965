import pytest
import torch

from kernels.reference.token_mask import apply_token_bitmask_reference, unpack_bitmask
from kernels.triton.token_mask import apply_token_bitmask
from tests.kernels._helpers import DEVICE


def _case(n, v, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g)
    allowed = torch.rand(n, v, generator=g) < 0.3
    words = -(-v // 32)
    padded = torch.zeros(n, words * 32, dtype=torch.bool)
    padded[:, :v] = allowed
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (padded.view(n, words, 32).long() * weights).sum(-1)
    bitmask = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    constrained = (torch.rand(n, generator=g) < 0.7).to(torch.int32)
    return logits, allowed, bitmask, constrained


def test_unpack_is_the_inverse_of_packing():
    _, allowed, bitmask, _ = _case(3, 77, 0)
    assert torch.equal(unpack_bitmask(bitmask, 77), allowed)


@pytest.mark.parametrize("n,v,block", [(1, 32, 32), (5, 100, 64), (4, 333, 128), (3, 1000, 4096)])
def test_kernel_matches_reference(n, v, block):
    logits, allowed, bitmask, constrained = _case(n, v, n * 1000 + v)
    ref = apply_token_bitmask_reference(logits, bitmask, constrained.bool())
    out = apply_token_bitmask(
        logits.clone().to(DEVICE), bitmask.to(DEVICE), constrained.to(DEVICE), block_v=block
    )
    assert torch.equal(out.cpu(), ref)
    # the reference itself: a constrained row keeps exactly its allowed logits
    for i in range(n):
        keep = allowed[i] if constrained[i] else torch.ones(v, dtype=torch.bool)
        assert torch.equal(torch.isfinite(ref[i]), keep)
        assert torch.equal(ref[i][keep], logits[i][keep])


def test_bf16_logits():
    logits, _, bitmask, constrained = _case(2, 96, 7)
    logits = logits.bfloat16()
    ref = apply_token_bitmask_reference(logits, bitmask, constrained.bool())
    out = apply_token_bitmask(logits.clone().to(DEVICE), bitmask.to(DEVICE), constrained.to(DEVICE))
    assert torch.equal(out.cpu(), ref)
