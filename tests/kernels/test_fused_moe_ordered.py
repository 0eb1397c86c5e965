"""fused_moe's ordered combine at invariant_config: the expert loop's result, and a
token's bits unchanged whatever tokens share the call, at every token count's tiles."""

import pytest
import torch

from kernels.reference.fused_moe import fused_moe_reference
from kernels.triton.fused_moe import fixed_config, fused_moe, invariant_config
from tests.kernels._helpers import rel_err
from tests.kernels.test_fused_moe import make_moe


def _ordered(x, w13, w2, weights, ids, kw, config=None):
    return fused_moe(x, w13, w2, weights, ids, **kw, config=config, ordered_combine=True,
                     out_dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_ordered_combine_matches_the_expert_loop(fmt):
    args, kw = make_moe(9, 128, 64, 8, 3, fmt, seed=4)
    got = _ordered(*args, kw)
    want = fused_moe_reference(*args, **kw).float()
    assert got.dtype == torch.float32 and rel_err(got, want) < 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_a_tokens_result_does_not_depend_on_the_other_tokens(fmt):
    (x, w13, w2, weights, ids), kw = make_moe(24, 128, 64, 8, 3, fmt, seed=6)
    alone = _ordered(x[:1], w13, w2, weights[:1], ids[:1], kw)
    for t in (2, 5, 24):
        got = _ordered(x[:t], w13, w2, weights[:t], ids[:t], kw)
        assert torch.equal(got[:1], alone), f"token 0 changed among {t} tokens"


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_many_tokens_take_larger_tiles_with_the_same_bits(fmt):
    # 160 tokens x 2 slots over 4 experts: the prefill heuristic's tiles, not the decode
    # ones; each token keeps the bits it has alone.
    (x, w13, w2, weights, ids), kw = make_moe(160, 128, 64, 4, 2, fmt, seed=8)
    many = invariant_config(160, 2, 4, 128, 64, fmt, x.device)
    assert many["BLOCK_M"] > fixed_config(fmt)["BLOCK_M"]
    got = _ordered(x, w13, w2, weights, ids, kw)
    for t in (0, 77, 159):
        alone = _ordered(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], kw)
        assert torch.equal(got[t : t + 1], alone), f"token {t}"


def test_ordered_combine_refuses_a_k_split():
    args, kw = make_moe(4, 128, 64, 8, 2, "bf16", seed=1)
    with pytest.raises(AssertionError, match="no K split"):
        _ordered(*args, kw, config=dict(fixed_config("bf16"), DOWN={"SPLIT_K": 2}))
