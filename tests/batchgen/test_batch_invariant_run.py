"""A run's texts do not depend on how it was batched or interrupted: seeded sampled rows
give the same text in an uninterrupted run, in a run with other batch sizes and chunking,
and in a run killed with kill -9 and resumed (real `batchgen run` subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from tests.batchgen.conftest import sentence_rows, write_job, write_parquet

ROWS = 12
_CLI = [sys.executable, "-c", "from batchgen.cli import main; main()"]


@pytest.fixture(scope="module")
def model() -> str:
    """The default model: a real 4-bit model whose near-tied logits turn any change in a
    row's arithmetic into a changed text."""
    return "smollm2-135m-instruct"


def _job(model: str, tmp_path: Path, name: str, max_num_seqs: int, batched: int) -> Path:
    data = tmp_path / "in.parquet"
    if not data.exists():
        write_parquet(data, sentence_rows(ROWS))
    return write_job(
        tmp_path / f"{name}.yaml",
        {
            "input": {"path": str(data)},
            "prompt": {"template": "Translate into French:\n{{ text }}"},
            "model": {"path": str(model)},
            "sampling": {"temperature": 0.9, "top_p": 0.95, "max_tokens": 12, "seed": 7},
            "batching": {
                "cluster": "off",
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": batched,
            },
            "output": {"path": str(tmp_path / name), "rows_per_part": 2},
        },
    )


def _texts(run: Path) -> dict[str, str]:
    df = pl.read_parquet(run / "results" / "*.parquet")
    assert sorted(df["id"].to_list()) == sorted(set(df["id"].to_list()))  # exactly once
    assert set(df["status"]) == {"ok"}
    return dict(zip(df["id"].to_list(), df["text"].to_list()))


def _parts(run: Path) -> int:
    manifest = run / "_manifest.jsonl"
    if not manifest.exists():
        return 0
    return sum(1 for line in manifest.read_text().splitlines() if line.endswith("}"))


def test_texts_equal_across_batch_sizes_and_a_kill_and_resume(model, tmp_path):
    clean = _job(model, tmp_path, "clean", max_num_seqs=16, batched=512)
    done = subprocess.run([*_CLI, "run", str(clean)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    want = _texts(tmp_path / "clean")
    assert len(want) == ROWS and len(set(want.values())) > ROWS // 2  # sampled, varied

    small = _job(model, tmp_path, "small", max_num_seqs=3, batched=24)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*_CLI, "run", str(small)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    deadline = time.time() + 300
    while _parts(tmp_path / "small") < 3:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() < deadline, "the run committed no parts in time"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = _parts(tmp_path / "small")
    assert committed * 2 < ROWS, "the job finished before it could be killed"
    rerun = subprocess.run([*_CLI, "run", str(small)], capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert _texts(tmp_path / "small") == want
    sessions = {
        json.loads(line)["session"]
        for line in (tmp_path / "small" / "_manifest.jsonl").read_text().splitlines()
        if line.endswith("}")
    }
    assert len(sessions) == 2  # the resumed session computed the rest
