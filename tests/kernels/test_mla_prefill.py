"""The query-tiled invariant prefill kernel against the decode kernel: each prompt query's
output has the decode kernel's bits for that query (same split rule, tiles and merge),
whatever the tile size, the value blocks and the chunk the query arrives in."""

import pytest
import torch

from kernels.reference.mla_decode import mla_decode_reference
from kernels.triton.mla_decode import mla_decode
from kernels.triton.mla_prefill import mla_prefill, query_tiles
from tests.kernels._helpers import DEVICE, rel_err


def make_prefill(prior, new, heads, kvl, r, bs, seed):
    """Sequences with `prior[i]` cached tokens and `new[i]` queries after them."""
    g = torch.Generator().manual_seed(seed)
    S = len(prior)
    max_blocks = max(-(-(p + n) // bs) for p, n in zip(prior, new))
    num_blocks = S * max_blocks + 2
    cache = torch.randn(num_blocks, bs, kvl + r, generator=g).bfloat16()
    tables = torch.randperm(num_blocks, generator=g)[: S * max_blocks].view(S, max_blocks)
    T = sum(new)
    q_c = torch.randn(T, heads, kvl, generator=g).bfloat16()
    q_r = torch.randn(T, heads, r, generator=g).bfloat16()
    lens = torch.tensor(
        [p + j + 1 for p, n in zip(prior, new) for j in range(n)], dtype=torch.int32
    )
    seq_of = torch.repeat_interleave(torch.arange(S), torch.tensor(new))
    dev = [v.to(DEVICE) for v in (q_c, q_r, cache, tables.to(torch.int32), lens)]
    return (*dev, seq_of.to(DEVICE))


def test_tiles_never_cross_a_sequence():
    assert query_tiles([5, 2, 0, 4], 4) == [(0, 4, 0), (4, 1, 0), (5, 2, 1), (7, 4, 3)]


# prior / new: a prompt from position 0 (queries of 1, 2, ... splits in one tile), a chunk
# after a cached prefix whose queries cross a split-count boundary, a single query, and a
# chunk after a long prefix (5 splits merged).
@pytest.mark.parametrize("q_tile,value_blocks", [(1, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("splits,heads", [(1, 3), (6, 3), (6, 20)])
def test_each_query_has_the_decode_kernels_bits(q_tile, value_blocks, splits, heads):
    prior, new = [0, 37, 9, 200], [23, 11, 1, 6]
    q_c, q_r, cache, tables, lens, seq_of = make_prefill(prior, new, heads, 32, 16, 8, seed=splits)
    scale = 48**-0.5
    got = mla_prefill(q_c, q_r, cache, tables, new, lens, scale, splits, q_tile=q_tile,
                      value_blocks=value_blocks, block_t=16)  # fmt: skip
    want = mla_decode(q_c, q_r, cache, tables[seq_of].contiguous(), lens, scale, splits,
                      block_t=16, value_blocks=1)  # fmt: skip
    assert torch.equal(got, want)
    ref = mla_decode_reference(q_c, q_r, cache, tables[seq_of].contiguous(), lens, scale)
    assert rel_err(got, ref) < 1e-2
