"""Launch config tables: `store` puts a config in front of the table for this process,
`write_entries` merges tuned entries into a copy of the committed table."""

import json

import torch

from kernels.triton import configs

H200 = "NVIDIA_H200"
CPU = torch.device("cpu")


def test_write_entries_merges_into_the_committed_table(tmp_path):
    tuned = {"T1_A1_E1_D2048_I2816_fp8": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128}}
    committed = (configs.CONFIG_DIR / "fused_moe.json").read_text()
    path = configs.write_entries("fused_moe", H200, tuned, tmp_path / "out")
    assert path == tmp_path / "out" / "fused_moe.json"
    table = json.loads(path.read_text())
    assert table[H200]["T1_A1_E1_D2048_I2816_fp8"] == tuned["T1_A1_E1_D2048_I2816_fp8"]
    assert "T1_A6_E64_D2048_I1408_bf16" in table[H200]  # committed entries kept
    assert (configs.CONFIG_DIR / "fused_moe.json").read_text() == committed  # only read


def test_write_entries_of_an_op_without_a_table(tmp_path):
    path = configs.write_entries("no_such_op", "interpreter", {"K": {"A": 1}}, tmp_path)
    assert json.loads(path.read_text()) == {"interpreter": {"K": {"A": 1}}}


def test_stored_configs_come_first_until_cleared():
    assert configs.lookup("fused_moe", "T1_test_key", CPU) is None
    try:
        configs.store("fused_moe", "T1_test_key", {"BLOCK_M": 16}, CPU)
        got = configs.lookup("fused_moe", "T1_test_key", CPU)
        assert got == {"BLOCK_M": 16}
        got["BLOCK_M"] = 32  # lookups hand out copies
        assert configs.lookup("fused_moe", "T1_test_key", CPU) == {"BLOCK_M": 16}
        assert configs.lookup("fp8_linear", "T1_test_key", CPU) is None  # per op
    finally:
        configs.clear_stored("fused_moe")
    assert configs.lookup("fused_moe", "T1_test_key", CPU) is None
