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
