import pytest
import torch

from kernels.reference.mla_decode import mla_decode_reference
from kernels.triton._arrival_counters import arrival_counters
from kernels.triton.mla_decode import (
    choose_num_splits,
    default_value_blocks,
    mla_decode,
    splits_for_context,
)
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


# (lens, launch splits): one split; short contexts under a launch sized for long ones
# (one split used, no merge); long ones merged by the last split (300 tokens at 16-token
# tiles uses 4 splits); 20 heads span two head blocks, the second partly masked.
@pytest.mark.parametrize(
    "lens,splits,heads",
    [([5, 37], 1, 3), ([70, 3, 1], 3, 3), ([33], 4, 3), ([5, 2], 8, 3), ([300, 5, 40], 8, 20)],
)
@pytest.mark.parametrize("prefetch,value_blocks", [(0, 1), (1, 1), (0, 2), (1, 2)])
def test_mla_decode_matches_reference(lens, splits, heads, prefetch, value_blocks):
    # prefetch 1: page indices one tile ahead; ([33], 4): a split whose prefetch of the
    # tile after its last one is masked off. value_blocks 2: each program owns half the
    # output columns (and, split, merges only those).
    args = make_case(lens, heads=heads, kvl=32, r=16, bs=16, seed=len(lens) + splits)
    scale = 48**-0.5
    out = mla_decode(*args, scale=scale, num_splits=splits, block_t=16, prefetch=prefetch,
                     value_blocks=value_blocks)  # fmt: skip
    assert out.shape == args[0].shape
    assert rel_err(out, mla_decode_reference(*args, scale=scale)) < 1e-2


def test_reference_reads_a_padded_context_without_a_sync():
    # The engine's contract: every row reads max_context slots (host-known, past some rows'
    # block tables), those past the row's device-side length masked; a NaN left in a slot
    # past a row's length (a stale entry) must not reach its output. Against a plain loop
    # over each row's own slots.
    lens = [5, 37, 1]
    q_c, q_r, cache, tables, lens_t = make_case(lens, heads=3, kvl=32, r=16, bs=16, seed=4)
    cache = cache.float()
    cache.view(-1, 48)[tables[0, 0].long() * 16 + 7] = float("nan")  # row 0's slot 7 > 5
    got = mla_decode_reference(q_c.float(), q_r.float(), cache, tables, lens_t, 0.2,
                               max_context=80)  # fmt: skip
    for b, n in enumerate(lens):
        t = torch.arange(n, device=cache.device)
        entries = cache.view(-1, 48)[tables[b, t // 16].long() * 16 + t % 16]  # [n, 48]
        c, k = entries[:, :32], entries[:, 32:]
        scores = (q_c[b].float() @ c.t() + q_r[b].float() @ k.t()) * 0.2  # [H, n]
        torch.testing.assert_close(got[b], scores.softmax(-1) @ c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_value_blocks_with_tiles_across_pages(prefetch):
    # 8-slot pages under 16-slot tiles: each tile's value slice is reloaded from two pages
    # (prefetch 1 holds the next tile's page indices beside the current ones); 64 latent
    # columns in 4 blocks of 16; 17 heads leave the second head block nearly all masked.
    args = make_case([47, 129], heads=17, kvl=64, r=16, bs=8, seed=9)
    want = mla_decode_reference(*args, scale=0.15)
    for value_blocks in (1, 4):
        out = mla_decode(*args, scale=0.15, num_splits=5, block_t=16, prefetch=prefetch,
                         value_blocks=value_blocks)  # fmt: skip
        assert rel_err(out, want) < 1e-2


def test_mla_decode_leaves_counters_zero_for_the_next_launch():
    # The same launch twice with other inputs: the merge must fire again (a counter left
    # non-zero would make no split the last one and leave `out` unwritten).
    for seed, value_blocks in ((1, 1), (2, 1), (3, 2), (4, 2)):
        args = make_case([300, 200], heads=20, kvl=32, r=16, bs=16, seed=seed)
        out = mla_decode(*args, scale=0.2, num_splits=6, block_t=16, value_blocks=value_blocks)
        assert rel_err(out, mla_decode_reference(*args, scale=0.2)) < 1e-2
        assert not arrival_counters(args[0].device, 8).any()


def test_partial_scratch_for_the_longest_context_gives_the_same_bits():
    # A launch sized for far longer contexts (num_splits 12), its split scratch allocated
    # only for the splits the longest row here uses: the same bits as the full scratch.
    args = make_case([300, 5, 129], heads=3, kvl=32, r=16, bs=16, seed=11)
    full = mla_decode(*args, scale=0.2, num_splits=12, block_t=16, value_blocks=1)
    kept = splits_for_context(300, 16)
    assert 1 < kept < 12
    small = mla_decode(*args, scale=0.2, num_splits=12, block_t=16, value_blocks=1,
                       partial_splits=kept)  # fmt: skip
    assert torch.equal(full, small)
    assert rel_err(small, mla_decode_reference(*args, scale=0.2)) < 1e-2


def test_value_blocks_only_while_the_programs_fit_the_sms():
    cpu = torch.device("cpu")  # 4 "SMs"
    assert default_value_blocks(1, 16, 1, 512, cpu) == 4  # 1 program -> 4
    assert default_value_blocks(1, 16, 2, 512, cpu) == 2  # 2 -> 4
    assert default_value_blocks(1, 16, 4, 512, cpu) == 1  # already fills the SMs
    assert default_value_blocks(1, 16, 1, 64, cpu) == 1  # blocks stay >= 64 columns


def test_splits_for_context_grow_like_a_square_root():
    assert [splits_for_context(n) for n in (1, 32, 200, 4096, 131072)] == [1, 1, 3, 16, 90]
    cpu = torch.device("cpu")  # 4 "SMs"
    assert choose_num_splits(1, 200, 16, cpu) == 3
    assert choose_num_splits(2, 4096, 16, cpu) == 2  # about one program per SM
    assert choose_num_splits(8, 4096, 16, cpu) == 1  # sequences alone fill the SMs


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("lens", [[1, 4096, 900, 17], [20000] * 2, [300] * 40])
def test_mla_decode_gpu_deepseek_shape(lens):
    args = make_case(lens, heads=128, kvl=512, r=64, bs=64, seed=len(lens))
    splits = choose_num_splits(len(lens), max(lens), 128, args[0].device)
    want = mla_decode_reference(*args, scale=192**-0.5)
    for prefetch, value_blocks in ((0, None), (1, None), (1, 4), (0, 2)):
        out = mla_decode(*args, scale=192**-0.5, num_splits=splits, prefetch=prefetch,
                         value_blocks=value_blocks)  # fmt: skip
        assert rel_err(out, want) < 1e-2
