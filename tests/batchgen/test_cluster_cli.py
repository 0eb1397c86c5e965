"""`batchgen cluster JOB --out FILE` through Click's runner."""

from __future__ import annotations

import logging

import polars as pl
from click.testing import CliRunner
from sklearn.metrics import adjusted_rand_score

from batchgen.cli import main
from tests.clustering.mixed_tasks import mixed_task_rows


def test_cluster_command_writes_assignments_and_prints_the_table(make_job, tmp_path, caplog):
    rows = mixed_task_rows(per_task=24, tasks=3)
    _, job_path = make_job(
        rows=rows, prompt={"template": "{{ prompt }}"}, batching={"cluster": "auto"}
    )
    out = tmp_path / "out" / "assignments.parquet"
    runner = CliRunner()
    args = ["cluster", str(job_path), "--out", str(out), "--min-cluster-size", "12"]
    caplog.set_level(logging.INFO, logger="batchgen.task_clusters")
    result = runner.invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    frame = pl.read_parquet(out)
    assert frame.columns == ["id", "cluster_id", "cluster_name"]
    assert frame["id"].to_list() == [r["id"] for r in rows]
    truth = [r["task"] for r in rows]
    assert adjusted_rand_score(truth, frame["cluster_id"].to_list()) >= 0.8
    assert "clusters over 72 prompts" in result.output
    for name in frame["cluster_name"].unique().to_list():
        assert name.split(" / ")[0] in result.output
    assert "embedded 72 texts" in caplog.text
    assert '"phase": "embedding", "rows_embedded": 72, "rows_total": 72' in result.stderr

    caplog.clear()
    again = runner.invoke(main, args, catch_exceptions=False)
    assert again.exit_code == 0 and "reloaded" in caplog.text and "embedded" not in caplog.text


def test_cluster_command_uses_a_task_column_as_is(make_job, tmp_path):
    rows = mixed_task_rows(per_task=3, tasks=2)
    _, job_path = make_job(
        rows=rows, prompt={"template": "{{ prompt }}"}, batching={"cluster": "task"}
    )
    out = tmp_path / "a.parquet"
    result = CliRunner().invoke(main, ["cluster", str(job_path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    frame = pl.read_parquet(out)
    assert frame["cluster_name"].to_list() == [r["task"] for r in rows]


def test_cluster_command_refuses_a_broken_job(make_job, tmp_path):
    _, job_path = make_job(prompt={"template": "{{ missing_column }}"})
    result = CliRunner().invoke(
        main, ["cluster", str(job_path), "--out", str(tmp_path / "a.parquet")]
    )
    assert result.exit_code == 2
    assert "missing_column" in result.output
    assert not (tmp_path / "a.parquet").exists()
