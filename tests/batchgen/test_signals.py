"""SIGTERM (a scheduler, systemd, `docker stop`) behaves like Ctrl-C: the rows in flight
finish within a bounded grace period, the part is committed, exit 5 with the resume
command; the rerun completes with every id exactly once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from batchgen.job_spec import JobError, parse_job
from batchgen.progress import Progress
from batchgen.run import EXIT_INTERRUPTED, run_job
from batchgen.run_dir import RunDir
from tests.batchgen.conftest import FakeLLM, sentence_rows
from tests.batchgen.run_process import (
    int_id_rows,
    job_file,
    manifest,
    results,
    run,
    start,
    wait_for_parts,
)


def test_sigterm_commits_the_part_and_exits_5(tiny_model_dir, tmp_path):
    rows = 80
    job = job_file(tiny_model_dir, tmp_path, int_id_rows(rows), tmp_path / "run")
    proc = start(job)
    wait_for_parts(proc, tmp_path / "run", parts=1)
    parts_at_signal = len(manifest(tmp_path / "run"))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    log = out.decode()
    assert proc.returncode == 5, log
    assert "SIGTERM: finishing the rows in flight" in log
    assert f"resume with `batchgen run {job}`" in log
    assert "Traceback" not in log
    done = len(results(tmp_path / "run"))
    assert 0 < done < rows
    # The rows in flight at the signal were finished and committed as a last part.
    assert len(manifest(tmp_path / "run")) > parts_at_signal
    assert not list((tmp_path / "run" / "results").glob(".*.tmp"))

    rerun = run(job)
    assert rerun.returncode == 0, rerun.stderr
    df = results(tmp_path / "run")
    assert sorted(df["id"].to_list()) == list(range(rows))  # exactly once
    assert sum(e["rows"] for e in manifest(tmp_path / "run")) == rows


class _HangingLLM(FakeLLM):
    """Delivers `after` outputs, then gets SIGTERM while its next step never ends: the
    grace period, not the engine, has to end the wait."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def stream(self, requests):
        for i, out in enumerate(super().stream(requests)):
            if i == self.after:
                os.kill(os.getpid(), signal.SIGTERM)
                while True:
                    time.sleep(0.01)
            yield out


def _run(job: dict, path, llm):
    progress = Progress(None, tty=False, interval=3600)
    return run_job(parse_job(job), path, llm=llm, progress=progress)


def test_grace_period_bounds_the_wait_for_rows_in_flight(make_job, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_STOP_GRACE_S", "0.5")
    job, path = make_job(rows=sentence_rows(40))
    started = time.monotonic()
    outcome = _run(job, path, _HangingLLM(after=13))
    assert time.monotonic() - started < 30
    assert outcome.exit_code == EXIT_INTERRUPTED
    assert "resume with" in outcome.message
    # The 13 rows that finished are committed; the ones stuck in flight are not.
    committed = sum(e.rows for e in RunDir(tmp_path / "run").live_parts())
    assert committed == 13
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored

    second = FakeLLM()
    assert _run(job, path, second).exit_code == 0
    assert second.pulled == 40 - 13


def test_bad_grace_period_is_refused(make_job, monkeypatch):
    monkeypatch.setenv("BATCHGEN_STOP_GRACE_S", "soon")
    job, path = make_job(rows=sentence_rows(4))
    with pytest.raises(JobError, match="BATCHGEN_STOP_GRACE_S: 'soon'"):
        _run(job, path, FakeLLM())


class _TermWhileLoading(FakeLLM):
    """SIGTERM arrives while the run is still setting up (here: asked for its tokenizer)."""

    @property
    def tokenizer(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value):
        self._tokenizer = value


def test_sigterm_before_generation_exits_5_with_nothing_lost(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(12))
    outcome = _run(job, path, _TermWhileLoading())
    assert outcome.exit_code == EXIT_INTERRUPTED
    assert "resume with `batchgen run" in outcome.message
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert _run(job, path, FakeLLM()).exit_code == 0
