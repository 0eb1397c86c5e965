"""validate, render and report on a tiny real model: thin CLI over the library."""

from __future__ import annotations

from click.testing import CliRunner

from batchgen.cli import main


def test_validate_render_run_report(make_job, tiny_model_dir, tmp_path):
    rows = [{"id": "a", "text": "Good {{ morning }}"}, {"id": "b", "text": None}]
    _, path = make_job(rows=rows, model=str(tiny_model_dir))
    runner = CliRunner()

    out = runner.invoke(main, ["validate", str(path)])
    assert out.exit_code == 0, out.output
    assert "rows: 2 (1 runnable)" in out.output and "null_input" in out.output
    assert "estimated time" in out.output
    assert not (tmp_path / "run").exists()  # validate writes nothing

    out = runner.invoke(main, ["render", str(path), "--n", "2"])
    assert out.exit_code == 0, out.output
    assert "<|im_start|>user\nTranslate into French:\nGood {{ morning }}<|im_end|>" in out.output

    out = runner.invoke(main, ["run", str(path)])
    assert out.exit_code == 3, out.output
    out = runner.invoke(main, ["report", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    assert "null_input" in out.output and f"batchgen run {path}" in out.output
