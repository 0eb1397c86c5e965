import json

import pytest
import torch

from batchgen.bench.step_tune import MoeEntry, candidate_stages, write_table
from kernels.triton import fused_moe

CPU = torch.device("cpu")


def _every_candidate(entry: MoeEntry, base: dict, bucket: int = 1) -> list[dict]:
    out = []
    for stage in candidate_stages(entry, base, bucket):
        out += stage(base)
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_shared_expert_candidates_are_configs_the_kernels_take(fmt):
    entry = MoeEntry("shared", 1, 1, 2048, 2816, fmt)
    base = entry.base(1, CPU)
    assert base == fused_moe.dense_config(1, 2048, 2816, fmt, CPU)
    swap = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, SWAP_AB=True,
                GU_SPLIT_K=4, SPLIT_K=4)  # fmt: skip
    for start in (base, swap):  # the heuristic here, the H200's tuned entry
        cands = _every_candidate(entry, start)
        assert any("DOWN" in c for c in cands)
        assert any("GU_SPLIT_K" in c for c in cands) == bool(start.get("SWAP_AB"))
        for cfg in cands:
            fused_moe._check_config(cfg, fmt)  # raises on a config the launches would reject


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_routed_candidates_are_configs_the_kernels_take(fmt):
    entry = MoeEntry("routed", 6, 64, 2048, 1408, fmt)
    base = entry.base(1, CPU)
    assert base == fused_moe.choose_config(1, 6, 64, 2048, 1408, fmt, CPU)
    int8 = dict(KERNEL="int8", BLOCK_M=1, BLOCK_N=32, BLOCK_K=512, num_warps=8)
    for start in [base] + ([int8] if fmt == "mxfp4" else []):
        for cfg in _every_candidate(entry, start):
            fused_moe._check_config(cfg, fmt)
            assert (cfg.get("KERNEL") == "int8") == (start.get("KERNEL") == "int8")


def test_entry_keys_are_the_fused_moe_table_keys():
    assert MoeEntry("shared", 1, 1, 2048, 2816, "fp8").key(8) == "T8_A1_E1_D2048_I2816_fp8"
    assert MoeEntry("routed", 6, 64, 2048, 1408, "mxfp4").key(5) == "T8_A6_E64_D2048_I1408_mxfp4"


def test_write_table_merges_into_the_committed_table(tmp_path):
    tuned = {"T1_A1_E1_D2048_I2816_fp8": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128}}
    path = write_table(tuned, tmp_path / "out", "NVIDIA_H200")
    table = json.loads(path.read_text())
    assert table["NVIDIA_H200"]["T1_A1_E1_D2048_I2816_fp8"] == tuned["T1_A1_E1_D2048_I2816_fp8"]
    assert "T1_A6_E64_D2048_I1408_bf16" in table["NVIDIA_H200"]  # committed entries kept
