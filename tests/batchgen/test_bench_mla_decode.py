"""`bench mla-decode` runs on a GPU only; here: its labelled engine launch is the one the
engine makes, and the sweep covers the settings its notes name."""

import inspect

import torch

from batchgen.bench.mla_decode import KVL, _settings, engine_settings
from kernels.triton.mla_decode import (
    choose_num_splits,
    default_num_warps,
    default_value_blocks,
    mla_decode,
)

ENGINE_PREFETCH = inspect.signature(mla_decode).parameters["prefetch"].default


def test_engine_row_uses_the_engines_own_launch_settings():
    cpu = torch.device("cpu")  # 4 "SMs"
    for batch, context in ((1, 256), (2, 4096), (256, 192)):
        s = engine_settings(batch, context, 16, cpu)
        splits = choose_num_splits(batch, context, 16, cpu)
        blocks = default_value_blocks(batch, 16, splits, KVL, cpu)
        assert s == dict(block_t=32, num_warps=default_num_warps(KVL, splits), num_stages=2,
                         splits=splits, prefetch=ENGINE_PREFETCH, value_blocks=blocks)  # fmt: skip
    assert engine_settings(256, 192, 16, cpu)["num_warps"] == 4  # one split: 4 warps
    assert engine_settings(1, 4096, 16, cpu)["num_warps"] == 8


def test_sweep_covers_tiles_warps_stages_and_prefetch():
    sweep = _settings(32, 1024, 128, torch.device("cpu"))
    assert {(s["block_t"], s["num_warps"], s["num_stages"]) for s in sweep} == {
        (t, w, st) for t in (16, 32, 64) for w in (4, 8) for st in (1, 2, 3)
    }
    assert {s["prefetch"] for s in sweep} == {0, 1}
    assert {s.get("value_blocks", 1) for s in sweep} == {1, 2, 4, 8}


def test_command_writes_the_json_after_every_case(tmp_path, monkeypatch):
    # The sweep itself needs a GPU; the case selection and the per-case writes do not.
    import json

    from click.testing import CliRunner

    from batchgen.bench import mla_decode

    written = []

    def fake_case(name, batch, context, heads, copy_bps, device):
        path = tmp_path / "bench" / "t.json"
        written.append(json.loads(path.read_text())["results"] if path.exists() else [])
        return [{"case": name, "us": 1.0}]

    monkeypatch.setattr(mla_decode.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mla_decode, "copy_bandwidth", lambda device: 4e12)
    monkeypatch.setattr(mla_decode, "bench_case", fake_case)
    monkeypatch.setattr("batchgen.bench.common.machine_info", lambda: {"gpu": "none"})
    monkeypatch.setattr("batchgen.bench.common.BENCH_DIR", tmp_path / "bench")
    result = CliRunner().invoke(mla_decode.command, ["--only", "b1-,v3", "--name", "t"])
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "bench" / "t.json").read_text())
    cases = ["moonlight-b1-ctx256", "moonlight-b1-ctx4096", "v3-b32-ctx1024"]
    assert [r["case"] for r in payload["results"]] == cases and payload["copy_tb_s"] == 4.0
    assert [len(w) for w in written] == [0, 1, 2]  # each case finds the ones before it on disk
    result = CliRunner().invoke(mla_decode.command, ["--only", "nothing"])
    assert result.exit_code == 1 and "matches none" in result.output
