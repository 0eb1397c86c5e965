"""The batch-invariant linears take one config per weight shape: the device's table entry
when it has one, never a function of the row count; the tuner's candidates are valid."""

import pytest
import torch

from kernels.triton import configs, fp8_linear, matmul
from kernels.tune.invariant_linear import fp8_candidates, matmul_candidates

CPU = torch.device("cpu")


def test_a_table_entry_replaces_the_heuristic_for_its_shape_only():
    tuned = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=4)
    key = matmul.shape_key(96, 256, torch.bfloat16)
    try:
        configs.store(matmul.TABLE, key, tuned, CPU)
        assert matmul.fixed_config(96, 256, torch.bfloat16, CPU) == tuned
        assert matmul.fixed_config(96, 256, torch.float32, CPU) == matmul.heuristic_config(
            96, 256, torch.float32, CPU
        )
        configs.store(fp8_linear.FIXED_TABLE, "fp8_N256_K512", dict(tuned, BLOCK_K=128), CPU)
        assert fp8_linear.fixed_config(256, 512, CPU)["BLOCK_K"] == 128
        assert fp8_linear.fixed_config(256, 1024, CPU) == fp8_linear.heuristic_fixed_config(
            256, 1024, CPU
        )
    finally:
        configs.clear_stored()


def test_the_committed_table_names_only_shapes():
    table = configs._table(matmul.TABLE)
    for device, entries in table.items():
        for key, cfg in entries.items():
            assert "_M" not in key, f"{device} {key}: an invariant config cannot depend on M"
            assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"} <= set(cfg)
            for rows, tiles in cfg.get("TILES", {}).items():
                assert int(rows) > 0 and set(tiles) <= configs.TILE_KEYS, f"{device} {key}"


def test_row_tiles_are_those_of_the_smallest_tuned_count_at_or_above_the_call():
    cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=3,
               TILES={"1": dict(BLOCK_M=16, BLOCK_N=16), "32": dict(BLOCK_M=32, BLOCK_N=32)})  # fmt: skip
    pick = {m: configs.with_row_tiles(cfg, m) for m in (1, 2, 32, 33)}
    assert (pick[1]["BLOCK_N"], pick[2]["BLOCK_N"], pick[32]["BLOCK_N"], pick[33]["BLOCK_N"]) == (
        16, 32, 32, 64)  # fmt: skip
    assert all("TILES" not in c and c["SPLIT_K"] == 4 and c["BLOCK_K"] == 64 for c in pick.values())
    # tiles may not carry the keys a row's bits depend on
    with pytest.raises(AssertionError, match="row tiles may set only"):
        configs.with_row_tiles(dict(cfg, TILES={"8": dict(SPLIT_K=2)}), 8)
    # from LARGE_M rows the matmul takes its large tiles, not the entry's row tiles
    large = matmul.launch_config(cfg, matmul.LARGE_M, torch.bfloat16)
    assert "TILES" not in large and large["BLOCK_M"] == matmul.LARGE_TILES["BLOCK_M"]


def test_candidates_split_k_into_whole_steps():
    for cands, block_k in (
        (matmul_candidates(3072, 2048, torch.bfloat16, CPU), None),
        (matmul_candidates(64, 2048, torch.float32, CPU), None),
        (fp8_candidates(576, 2048, CPU), 128),
    ):
        assert len({str(sorted(c.items())) for c in cands}) == len(cands)
        for cfg in cands[1:]:
            steps = -(-2048 // cfg["BLOCK_K"])
            assert cfg["SPLIT_K"] == 1 or steps // cfg["SPLIT_K"] >= 2
            if block_k:
                assert cfg["BLOCK_K"] == block_k


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="Triton picks the interpreter at import: on a GPU machine CPU tensors reach the "
    "compiled kernel (test_matmul.py covers the GPU)",
)
def test_a_row_computed_alone_equals_the_row_among_many_with_a_tuned_config(monkeypatch):
    # the interpreter: the config's tiles and split decide the order a row is summed in
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=gen)
    x = torch.randn(20, 96, generator=gen)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)
    many = matmul.fixed_linear(x, w, config=cfg)
    for m in (1, 3, 17):
        assert torch.equal(matmul.fixed_linear(x[:m], w, config=cfg), many[:m])
    torch.testing.assert_close(many, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="Triton picks the interpreter at import (test_matmul.py covers the GPU)",
)
def test_row_tiles_leave_every_output_bit_as_the_shapes_own_tiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(80, 192, generator=gen)
    x = torch.randn(24, 192, generator=gen)
    own = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)
    tiled = dict(own, TILES={"1": dict(BLOCK_M=16, BLOCK_N=16), "8": dict(BLOCK_N=32)})
    for m in (1, 5, 8, 24):
        assert torch.equal(matmul.fixed_linear(x[:m], w, config=tiled),
                           matmul.fixed_linear(x[:m], w, config=own))  # fmt: skip
    codes = (torch.randn(256, 256, generator=gen) * 8).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=gen) / 16
    xb = torch.randn(9, 256, generator=gen).to(torch.bfloat16)
    own = dict(KERNEL="dot", BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4,
               num_stages=2)  # fmt: skip
    tiled = dict(own, TILES={"4": dict(BLOCK_M=16, BLOCK_N=16)})
    for m in (1, 4, 9):
        assert torch.equal(
            fp8_linear.fp8_block_linear(xb[:m], codes, scale, config=tiled),
            fp8_linear.fp8_block_linear(xb[:m], codes, scale, config=own),
        )


def test_row_tiles_are_kept_only_if_every_row_count_they_serve_keeps_its_bits(monkeypatch):
    # a stand-in kernel: narrow column tiles change the bits at 3 rows only, and are faster
    from kernels.tune import invariant_linear

    def call(cfg, m, w):
        return torch.tensor([float(m), float(cfg["BLOCK_N"] if m == 3 else 0)])

    monkeypatch.setattr(
        invariant_linear, "time_chain", lambda calls, *a: calls[0].args[0]["BLOCK_N"]
    )
    own = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=3)
    tiles, report = invariant_linear._tune_tiles(own, (1, 8), [None], call)
    assert tiles == {"1": dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=4)}
    assert report[8]["serves_rows"] == [2, 8] and report[8]["candidates_with_other_bits"] == 3


def test_the_shape_config_is_kept_only_if_every_row_keeps_its_bits_at_every_row_count():
    # a stand-in kernel whose sixth row changes with the row count: rows 0-3 alone agree
    from kernels.tune import invariant_linear

    def call(cfg, m, w):
        out = torch.arange(m, dtype=torch.float32)
        if m > 5 and cfg["SPLIT_K"] == 2:
            out[5] += m
        return out

    ok = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=3)
    assert invariant_linear._invariant(ok, (1, 8, 64), [None], call)
    assert not invariant_linear._invariant(dict(ok, SPLIT_K=2), (1, 8, 64), [None], call)
