"""Crash safety with real processes: kill -9 mid-run, then the same command finishes the
job with every id exactly once and without recomputing committed parts; Ctrl-C (SIGINT)
writes the current part and exits 5, resumable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

from tests.batchgen.conftest import sentence_rows, write_job, write_parquet

ROWS = 120
_CLI = [sys.executable, "-c", "from batchgen.cli import main; main()"]


def _job(tiny_model_dir: Path, tmp_path: Path) -> Path:
    data = write_parquet(tmp_path / "in.parquet", sentence_rows(ROWS))
    return write_job(
        tmp_path / "job.yaml",
        {
            "input": {"path": str(data)},
            "prompt": {"template": "Translate into French:\n{{ text }}"},
            "model": {"path": str(tiny_model_dir)},
            "sampling": {"temperature": 0.0, "max_tokens": 12},
            "batching": {"cluster": "off", "max_num_seqs": 4},
            "output": {"path": str(tmp_path / "run"), "rows_per_part": 10},
        },
    )


def _manifest(tmp_path: Path) -> list[dict]:
    path = tmp_path / "run" / "_manifest.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _start(job: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [*_CLI, "run", str(job)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )


def _wait_for_parts(proc: subprocess.Popen, tmp_path: Path, parts: int) -> None:
    deadline = time.time() + 240
    while len(_manifest(tmp_path)) < parts:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() < deadline, "the run committed no parts in time"
        time.sleep(0.2)


def _ids_by_part(tmp_path: Path, parts: list[str]) -> dict[str, list[str]]:
    results = tmp_path / "run" / "results"
    return {p: sorted(pl.read_parquet(results / p)["id"].to_list()) for p in parts}


def test_kill_9_then_resume(tiny_model_dir, tmp_path):
    job = _job(tiny_model_dir, tmp_path)
    proc = _start(job)
    _wait_for_parts(proc, tmp_path, parts=2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = [e["part"] for e in _manifest(tmp_path)]
    committed = _ids_by_part(tmp_path, before)
    n_committed = sum(len(v) for v in committed.values())
    assert n_committed < ROWS, "the job finished before it could be killed"

    rerun = subprocess.run([*_CLI, "run", str(job)], capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr

    df = pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")
    assert sorted(df["id"].to_list()) == [f"r{i:04d}" for i in range(ROWS)]  # exactly once
    assert set(df["status"]) == {"ok"}
    entries = _manifest(tmp_path)
    # Parts committed before the kill are untouched and still count ...
    assert _ids_by_part(tmp_path, before) == committed
    # ... and the second session computed only the rest.
    later = [e for e in entries if e["part"] not in before]
    assert sum(e["rows"] for e in later) == ROWS - n_committed
    assert (tmp_path / "run" / "_SUCCESS").exists()


def test_ctrl_c_writes_the_part_and_exits_5(tiny_model_dir, tmp_path):
    job = _job(tiny_model_dir, tmp_path)
    proc = _start(job)
    _wait_for_parts(proc, tmp_path, parts=1)
    parts_at_signal = len(_manifest(tmp_path))
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 5, out.decode()
    assert b"resume with" in out
    df = pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")
    done = len(df)
    assert 0 < done < ROWS
    # The rows in flight at the interrupt were finished and written as a last part.
    assert len(_manifest(tmp_path)) > parts_at_signal
    rerun = subprocess.run([*_CLI, "run", str(job)], capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    df = pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")
    assert sorted(df["id"].to_list()) == [f"r{i:04d}" for i in range(ROWS)]


def test_kill_9_with_clustering_reuses_embeddings_and_assignments(tiny_model_dir, tmp_path):
    job = _job(tiny_model_dir, tmp_path)
    text = (
        job.read_text()
        .replace("cluster: 'off'", "cluster: auto")
        .replace("cluster: off", "cluster: auto")
    )
    assert "cluster: auto" in text
    job.write_text(text)
    proc = _start(job)
    _wait_for_parts(proc, tmp_path, parts=1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = proc.stdout.read().decode()
    assert "task clusters: embedded" in first  # the first session embedded the prompts
    assert (tmp_path / "run" / "clusters" / "assignments.parquet").exists()

    rerun = subprocess.run([*_CLI, "run", str(job)], capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    log = rerun.stdout + rerun.stderr
    # no second embedding pass: the stored assignments are reloaded as they are
    assert "task clusters: reloaded" in log and "task clusters: embedded" not in log
    df = pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")
    assert sorted(df["id"].to_list()) == [f"r{i:04d}" for i in range(ROWS)]
    assert df["cluster_id"].null_count() == 0
