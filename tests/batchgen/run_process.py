"""Helpers for tests that run `batchgen` as a real process on the tiny model: a job file
over integer ids, the manifest as written, and the results as one dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl

from tests.batchgen.conftest import sentence_rows, write_job, write_parquet

CLI = [sys.executable, "-c", "from batchgen.cli import main; main()"]


def int_id_rows(count: int, **extra_columns) -> list[dict]:
    return [
        {"id": i, "text": r["text"], **{k: v(i) for k, v in extra_columns.items()}}
        for i, r in enumerate(sentence_rows(count))
    ]


def job_file(
    model_dir: Path, directory: Path, rows: list[dict], run_path: Path, **sections
) -> Path:
    data = directory / "in.parquet"
    if not data.exists():
        write_parquet(data, rows)
    job = {
        "input": {"path": str(data)},
        "prompt": {"template": "Translate into French:\n{{ text }}"},
        # A small KV cache: allocating the default 2 GiB costs seconds per process.
        "model": {"path": str(model_dir), "kv_cache_memory": 4_000_000},
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "batching": {"cluster": "off", "max_num_seqs": 4},
        "output": {"path": str(run_path), "rows_per_part": 10},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return write_job(directory / "job.yaml", job)


def run(job: Path, *args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "run", str(job), *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )


def start(job: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, "run", str(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )


def manifest(run_path: Path) -> list[dict]:
    path = run_path / "_manifest.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for_parts(proc: subprocess.Popen, run_path: Path, parts: int) -> None:
    deadline = time.time() + 240
    while len(manifest(run_path)) < parts:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() < deadline, "the run committed no parts in time"
        time.sleep(0.1)


def results(run_path: Path) -> pl.DataFrame:
    return pl.read_parquet(run_path / "results" / "*.parquet")
