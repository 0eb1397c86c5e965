"""fused_moe's ordered combine with its fixed config: the expert loop's result, and a
token's bits unchanged whatever tokens share the call."""

import pytest
import torch

from kernels.reference.fused_moe import fused_moe_reference
from kernels.triton.fused_moe import fixed_config, fused_moe
from tests.kernels._helpers import rel_err
from tests.kernels.test_fused_moe import make_moe


def _ordered(x, w13, w2, weights, ids, kw, config=None):
    return fused_moe(x, w13, w2, weights, ids, **kw, config=config or fixed_config(kw["fmt"]),
                     ordered_combine=True, out_dtype=torch.float32)  # fmt: skip


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


def test_ordered_combine_refuses_a_k_split():
    args, kw = make_moe(4, 128, 64, 8, 2, "bf16", seed=1)
    with pytest.raises(AssertionError, match="no K split"):
        _ordered(*args, kw, config=dict(fixed_config("bf16"), DOWN={"SPLIT_K": 2}))
