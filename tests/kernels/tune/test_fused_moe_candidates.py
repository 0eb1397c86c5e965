"""The fused MoE tuner's candidates are configs the kernels accept; its second stage
proposes tiles of the down launch's own (fused_moe's DOWN), none the winner's own again."""

from __future__ import annotations

import pytest

from kernels.triton.fused_moe import _check_config, default_config, down_config
from kernels.tune.fused_moe import (
    down_candidates,
    moe_candidates,
    mxfp4_candidates,
    prefill_candidates,
)


@pytest.mark.parametrize(
    ("best", "fmt"),
    [
        (
            dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, SWAP_AB=True),
            "bf16",
        ),
        (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3), "fp8"),
        (dict(KERNEL="int8", BLOCK_M=1, BLOCK_N=32, BLOCK_K=512, num_warps=4), "mxfp4"),
    ],
)
def test_down_candidates_are_valid_and_new(best, fmt):
    cands = down_candidates(best)
    assert cands
    own = down_config(best)
    for cfg in cands:
        _check_config(cfg, fmt)  # raises on a config the kernels cannot run
        down = down_config(cfg)
        assert {k: v for k, v in cfg.items() if k != "DOWN"} == best  # gate+up untouched
        assert any(down.get(k, 1) != own.get(k, 1) for k in cfg["DOWN"])
    if best.get("SWAP_AB"):  # wgmma wants 64 weight rows per warpgroup
        assert all(c["DOWN"]["BLOCK_N"] >= 64 for c in cands)


@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_first_stage_candidates_are_configs_the_kernels_take(fmt, tokens):
    base = default_config(tokens * 6, 64, fmt)
    if fmt == "mxfp4":
        cands = mxfp4_candidates(base, tokens, int8=True)
        assert any(c.get("KERNEL") == "int8" for c in cands) == (tokens <= 8)
    else:
        cands = moe_candidates(base, fmt)
    assert cands[0] == base
    for cfg in cands:
        _check_config(cfg, fmt)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_prefill_candidates_come_in_both_launch_orders(fmt):
    base = default_config(4096 * 6, 64, fmt)
    cands = prefill_candidates(base)
    for cfg in cands:
        _check_config(cfg, fmt)
    assert {c["GROUP_M"] for c in cands} == {1, 8}
