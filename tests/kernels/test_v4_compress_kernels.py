"""The V4 decode-step compressor and indexer-score kernels against their torch twin
(kernels/reference/v4_compress.py), and the twin against the engine's compressor
(engine/ops/v4_compress.py's compress_chunk with T = 1 after a prefix) and indexer
(indexer_scores, indexer_topk)."""

from __future__ import annotations

import pytest
import torch

from engine.ops.v4_compress import compress_chunk, indexer_scores, indexer_topk
from kernels.reference.v4_compress import compress_decode_reference, indexer_scores_reference
from kernels.triton.v4_compress import v4_compress_decode, v4_indexer_scores
from tests.kernels._helpers import DEVICE, gpu_only

BLOCK_SIZE = 16
EPS = 1e-6


def inv_freq_for(rope_dim: int) -> torch.Tensor:
    return 1.0 / (160000.0 ** (torch.arange(0, rope_dim, 2).float() / rope_dim))


def paged(bsz: int, max_blocks: int, g: torch.Generator) -> torch.Tensor:
    """Scrambled block tables [B, max_blocks] int32 over bsz * max_blocks + 3 blocks."""
    pages = torch.randperm(bsz * max_blocks + 3, generator=g)[: bsz * max_blocks]
    return pages.view(bsz, max_blocks).to(torch.int32)


def compressor_case(positions, ratio, overlap, d, rope_dim=8, lookahead=0,
                    dtype=torch.float32, block_size=BLOCK_SIZE, seed=0):  # fmt: skip
    """A compressor's decode state for one token per sequence at `positions`: the pooling
    states after each sequence's prefix 0..p-1 went through compress_chunk (rows never
    written hold NaN), a cache of NaN, and the step's inputs. -> (args of
    v4_compress_decode, each sequence's prefix state [2, reach, W] for the engine)."""
    g = torch.Generator().manual_seed(seed)
    bsz, width = len(positions), 2 * d if overlap else d
    reach = (2 * ratio if overlap else ratio) + lookahead
    ape = torch.randn(ratio, width, generator=g)
    norm = torch.rand(d, generator=g) + 0.5
    inv_freq = inv_freq_for(rope_dim)
    slots = torch.randperm(bsz + 2, generator=g)[:bsz]
    state = torch.full((bsz + 2, 2, reach, width), float("nan"))
    prefix_states = []
    for b, p in enumerate(positions):
        kv = torch.randn(p, width, generator=g).to(dtype)
        score = (torch.randn(p, width, generator=g) * 2).to(dtype)
        own = torch.full((2, reach, width), float("nan"))
        if p:
            compress_chunk(kv, score, 0, own, ape, overlap, norm, EPS, inv_freq)
        state[slots[b]] = own
        prefix_states.append(own)
    max_blocks = max(positions) // block_size + 2
    tables = paged(bsz, max_blocks, g)
    cache = torch.full((bsz * max_blocks + 3, block_size // ratio, d), float("nan"), dtype=dtype)
    kv = torch.randn(bsz, width, generator=g).to(dtype)
    score = (torch.randn(bsz, width, generator=g) * 2).to(dtype)
    args = [kv, score, ape, state, cache, torch.tensor(positions), slots, tables, norm,
            inv_freq]  # fmt: skip
    return [a.to(DEVICE) for a in args] + [EPS, overlap], prefix_states


def clone_args(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


# CSA m = 4: window 0's close (window -1's Ca slots), other closes, rows that close nothing,
# position 0; HCA m = 8 and m = 4 (no overlap).
CASES = [
    (4, True, [3, 7, 0, 5, 38, 39, 12]),
    (8, False, [7, 15, 0, 12, 23, 31]),
    (4, False, [3, 6, 19]),
]


@pytest.mark.parametrize("ratio,overlap,positions", CASES)
@pytest.mark.parametrize("lookahead", [0, 3])
def test_reference_matches_the_engines_compress_chunk(ratio, overlap, positions, lookahead):
    # the twin's step = compress_chunk of the one token after the same prefix state
    args, prefix_states = compressor_case(positions, ratio, overlap, d=16, lookahead=lookahead)
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    kv, score, ape, state, cache, pos, slots, tables, norm, inv_freq, eps, _ = args
    compress_decode_reference(*args)
    for b, p in enumerate(positions):
        own = prefix_states[b].clone()
        entries, first = compress_chunk(kv[b : b + 1], score[b : b + 1], p, own, ape, overlap,
                                        norm, eps, inv_freq)  # fmt: skip
        assert torch.equal(state[slots[b]].nan_to_num(7.0), own.nan_to_num(7.0)), f"row {b}"
        assert entries.shape[0] == (1 if p % ratio == ratio - 1 else 0), f"row {b}"
        if entries.shape[0]:
            assert first == p // ratio
            block, row = int(tables[b, p // BLOCK_SIZE]), (p // ratio * ratio % BLOCK_SIZE) // ratio
            torch.testing.assert_close(cache[block, row], entries[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ratio,overlap,positions", CASES)
@pytest.mark.parametrize("lookahead", [0, 3])
def test_compress_kernel_matches_reference_float32(ratio, overlap, positions, lookahead):
    args, _ = compressor_case(positions, ratio, overlap, d=16, lookahead=lookahead, seed=1)
    want = clone_args(args)
    v4_compress_decode(*args)
    compress_decode_reference(*want)
    # the state rows bit for bit; entries within float rounding; every other cache row
    # (non-closing rows write nothing) still NaN
    assert torch.equal(args[3].nan_to_num(7.0), want[3].nan_to_num(7.0))
    torch.testing.assert_close(args[4], want[4], rtol=1e-5, atol=1e-5, equal_nan=True)
    assert not torch.isnan(args[4]).all(), "no entry written"


def test_compress_kernel_matches_reference_bfloat16_with_pooling_tiles():
    # HCA m = 64 at d = 128: pooling tiles of 2048 // 64 = 32 slots, two per window
    args, _ = compressor_case([63, 127, 10], 64, False, d=128, dtype=torch.bfloat16,
                              block_size=128, seed=2)  # fmt: skip
    want = clone_args(args)
    v4_compress_decode(*args)
    compress_decode_reference(*want)
    assert torch.equal(args[3].nan_to_num(7.0), want[3].nan_to_num(7.0))
    assert args[4].dtype == torch.bfloat16
    torch.testing.assert_close(args[4].float(), want[4].float(), rtol=1e-2, atol=1e-2,
                               equal_nan=True)  # fmt: skip


def indexer_case(positions, heads=2, dim=16, ratio=4, dtype=torch.float32, seed=0,
                 block_size=BLOCK_SIZE):  # fmt: skip
    """q, weights, the paged keys (uncommitted rows NaN), positions, block tables, and
    every sequence's committed keys [n_b, d_i] in order."""
    g = torch.Generator().manual_seed(seed)
    bsz = len(positions)
    max_blocks = max(positions) // block_size + 2
    tables = paged(bsz, max_blocks, g)
    keys = torch.full((bsz * max_blocks + 3, block_size // ratio, dim), float("nan"))
    own = []
    for b, p in enumerate(positions):
        n = (p + 1) // ratio
        k = torch.randn(n, dim, generator=g).to(dtype).float()
        for w in range(n):
            keys[tables[b, w * ratio // block_size], (w * ratio % block_size) // ratio] = k[w]
        own.append(k)
    q = torch.randn(bsz, heads, dim, generator=g).to(dtype)
    weights = torch.randn(bsz, heads, generator=g).to(dtype)
    args = [q, weights, keys.to(dtype), torch.tensor(positions), tables]
    return [a.to(DEVICE) for a in args], own


INDEXER_POSITIONS = [[0, 2, 3, 17, 70, 130], [9, 63, 64, 1]]


@pytest.mark.parametrize("positions", INDEXER_POSITIONS)
def test_indexer_reference_matches_the_engine(positions):
    args, own = indexer_case(positions, seed=3)
    args = [a.cpu() for a in args]
    q, weights, _, pos, _ = args
    scores = indexer_scores_reference(*args, ratio=4)
    for b, p in enumerate(positions):
        n = (p + 1) // 4
        want = indexer_scores(q[b : b + 1], own[b], weights[b : b + 1])[0]
        torch.testing.assert_close(scores[b, :n], want, rtol=1e-6, atol=1e-6)
        assert torch.isinf(scores[b, n:]).all() and (scores[b, n:] < 0).all()


@pytest.mark.parametrize("positions", INDEXER_POSITIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_kernel_matches_reference(positions, dtype):
    args, _ = indexer_case(positions, heads=3, dim=32, dtype=dtype, seed=4)
    got = v4_indexer_scores(*args, ratio=4, block_n=16)
    want = indexer_scores_reference(*args, ratio=4)
    assert got.shape == want.shape == (len(positions), args[4].shape[1] * BLOCK_SIZE // 4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_indexer_kernel_selection_equals_indexer_topk_tie_aware():
    # two heads: about a quarter of the scores are exactly 0 (ReLU), so top-k ties
    positions, topk = [70, 130, 6, 2], 8
    args, own = indexer_case(positions, seed=5)
    q, weights, _, pos, _ = args
    scores = v4_indexer_scores(*args, ratio=4, block_n=16)
    values, picked = scores.topk(topk, dim=-1)
    picked = torch.where(values == float("-inf"), -1, picked)
    for b, p in enumerate(positions):
        engine = indexer_scores(q[b : b + 1].cpu(), own[b], weights[b : b + 1].cpu())
        want = indexer_topk(engine, pos[b : b + 1].cpu(), 4, topk)[0]
        mine = picked[b].cpu()
        # the engine's selection has min(topk, n) columns; the kernel's pads with -1
        assert (mine >= 0).sum() == (want >= 0).sum() == min(topk, (p + 1) // 4)
        torch.testing.assert_close(engine[0][mine[mine >= 0]].sort().values,
                                   engine[0][want[want >= 0]].sort().values,
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


@gpu_only
@pytest.mark.parametrize("ratio,overlap,d", [(128, False, 512), (4, True, 512), (4, True, 128)])
def test_compress_kernel_at_v4_flash_sizes(ratio, overlap, d):
    # HCA, CSA's compressor, CSA's indexer compressor; bf16 projections, rope 64
    positions = [127, 255, 5, 1023, 4095, 130, 3, 67]
    args, _ = compressor_case(positions, ratio, overlap, d=d, rope_dim=64, lookahead=3,
                              dtype=torch.bfloat16, block_size=128, seed=6)  # fmt: skip
    want = clone_args(args)
    v4_compress_decode(*args)
    compress_decode_reference(*want)
    assert torch.equal(args[3].nan_to_num(7.0), want[3].nan_to_num(7.0))
    torch.testing.assert_close(args[4].float(), want[4].float(), rtol=2e-2, atol=2e-2,
                               equal_nan=True)  # fmt: skip


@gpu_only
def test_indexer_kernel_at_v4_flash_sizes():
    positions = [8191, 100, 4095, 3]
    args, _ = indexer_case(positions, heads=64, dim=128, dtype=torch.bfloat16, seed=7,
                           block_size=128)  # fmt: skip
    got = v4_indexer_scores(*args, ratio=4)
    want = indexer_scores_reference(*args, ratio=4)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
