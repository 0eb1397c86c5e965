"""The kernel tuner's second stage proposes tiles of the MoE down launch's own (fused_moe's
DOWN), each a config the kernels accept, none the winner's own tile again."""

from __future__ import annotations

import pytest

from batchgen.bench.kernels import _down_candidates
from kernels.triton.fused_moe import _check_config, down_config


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
    cands = _down_candidates(best)
    assert cands
    own = down_config(best)
    for cfg in cands:
        _check_config(cfg, fmt)  # raises on a config the kernels cannot run
        down = down_config(cfg)
        assert {k: v for k, v in cfg.items() if k != "DOWN"} == best  # gate+up untouched
        assert any(down.get(k, 1) != own.get(k, 1) for k in cfg["DOWN"])
    if best.get("SWAP_AB"):  # wgmma wants 64 weight rows per warpgroup
        assert all(c["DOWN"]["BLOCK_N"] >= 64 for c in cands)
