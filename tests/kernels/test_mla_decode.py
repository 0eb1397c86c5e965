import pytest
import torch

from kernels.reference.mla_decode import mla_decode_reference
from kernels.triton.mla_decode import choose_num_splits, mla_decode
from tests.kernels._helpers import DEVICE, gpu_only, rel_err


def make_case(lens, heads, kvl, r, bs, seed):
    g = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    max_blocks = max(-(-n // bs) for n in lens)
    num_blocks = bsz * max_blocks + 3
    cache = torch.randn(num_blocks, bs, kvl + r, generator=g).bfloat16()
    # Scattered, non-contiguous pages, as a block manager hands them out.
    perm = torch.randperm(num_blocks, generator=g)[: bsz * max_blocks]
    tables = perm.view(bsz, max_blocks).to(torch.int32)
    q_c = torch.randn(bsz, heads, kvl, generator=g).bfloat16()
    q_r = torch.randn(bsz, heads, r, generator=g).bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return [v.to(DEVICE) for v in (q_c, q_r, cache, tables, lens_t)]


@pytest.mark.parametrize("lens,splits", [([5, 37], 1), ([70, 3, 1], 3), ([33], 4)])
def test_mla_decode_matches_reference(lens, splits):
    args = make_case(lens, heads=3, kvl=32, r=16, bs=16, seed=len(lens) + splits)
    scale = 48**-0.5
    out = mla_decode(*args, scale=scale, num_splits=splits, block_t=16)
    assert out.shape == args[0].shape
    assert rel_err(out, mla_decode_reference(*args, scale=scale)) < 1e-2


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("lens", [[1, 4096, 900, 17], [20000] * 2])
def test_mla_decode_gpu_deepseek_shape(lens):
    args = make_case(lens, heads=128, kvl=512, r=64, bs=64, seed=len(lens))
    splits = choose_num_splits(len(lens), max(lens), 128, args[0].device)
    out = mla_decode(*args, scale=192**-0.5, num_splits=splits)
    assert rel_err(out, mla_decode_reference(*args, scale=192**-0.5)) < 1e-2
