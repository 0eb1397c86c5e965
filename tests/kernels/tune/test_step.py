"""The in-step tuner's candidates are configs the kernels take, its keys are the fused_moe
table's, and its descent keeps the fastest config of each entry (timed here by a cost of
the stored config instead of a GPU step)."""

import pytest
import torch

from kernels.triton import configs, fused_moe
from kernels.tune.step import OP, MoeEntry, candidate_stages, tune_entries

CPU = torch.device("cpu")


def _every_candidate(entry: MoeEntry, base: dict) -> list[dict]:
    out = []
    for stage in candidate_stages(entry, base):
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


def test_descent_keeps_each_entrys_fastest_config_and_times_later_ones_beside_it():
    routed = MoeEntry("routed", 6, 64, 2048, 1408, "bf16")
    shared = MoeEntry("shared", 1, 1, 2048, 2816, "bf16")
    seen = []

    def step_ms() -> float:
        # a step whose time falls with the routed BLOCK_N and with the shared down's split
        r = configs.lookup(OP, routed.key(1), CPU)
        s = configs.lookup(OP, shared.key(1), CPU)
        seen.append((r, s))
        split = fused_moe.down_config(s).get("SPLIT_K", 1) if s else 1
        return 10.0 - r["BLOCK_N"] / 64 - split / 8

    try:
        tuned, rows = tune_entries([routed, shared], 1, CPU, step_ms, log=lambda _: None)
        assert tuned[routed.key(1)]["BLOCK_N"] == 128
        assert fused_moe.down_config(tuned[shared.key(1)])["SPLIT_K"] == 8
        # the shared entry was timed beside the routed entry's best
        assert all(r == tuned[routed.key(1)] for r, s in seen if s is not None)
        assert len(rows) == len(seen) and sum(r.get("base", False) for r in rows) == 2
        for key, cfg in tuned.items():  # the bests stay stored until cleared
            assert configs.lookup(OP, key, CPU) == cfg
    finally:
        configs.clear_stored(OP)
    assert configs.lookup(OP, routed.key(1), CPU) is None  # no interpreter table entry
