"""`batchgen bench decode` end to end on the tiny random llama (few tokens, no timing
asserted): both engines run, every request yields its tokens, the JSON is written."""

from __future__ import annotations

import json

from click.testing import CliRunner

from batchgen.bench.decode import command, default_name


def test_bench_decode_writes_rows_for_both_engines(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("batchgen.bench.common.BENCH_DIR", tmp_path / "bench")
    args = ["--model", str(tiny_model_dir), "--batches", "1,3", "--hf-batches", "2"]
    result = CliRunner().invoke(command, [*args, "--new-tokens", "3", "--name", "t"])
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "bench" / "t.json").read_text())
    rows = {(r["engine"], r["batch"]): r for r in payload["results"]}
    assert set(rows) == {("batchgen", 1), ("batchgen", 3), ("transformers", 2)}
    for (_, batch), row in rows.items():
        assert row["output_tokens"] == batch * 3  # ignore_eos / min_new_tokens hold
        assert row["tok_s"] > 0 and row["seconds"] > 0
    assert payload["device"] == "cpu" and payload["machine"]["cpu_count"]
    assert "transformers" in result.output and "tok/s" in result.output


def test_default_names():
    assert default_name("smollm2-135m-instruct", "cpu") == "decode-cpu-smollm2"
    assert default_name("/models/Moon_Light-16B/", "cuda") == "decode-cuda-moon-light-16b"
    assert default_name("/m/tiny.Q4_1.gguf", "cpu") == "decode-cpu-tiny-q4-1"
