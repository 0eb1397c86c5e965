"""One run at a time per output directory: a second `batchgen run` while one is running is
refused (exit 2, naming the holder's pid and host) and touches nothing; the lock goes with
its process, so a `kill -9` never leaves it stale."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from batchgen.job_spec import JobError, parse_job
from batchgen.progress import Progress
from batchgen.run import run_job
from batchgen.run_lock import RunLock, held_by, lock_path
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


def test_second_run_on_the_same_directory_is_refused(tiny_model_dir, tmp_path):
    rows = 40
    job = job_file(
        tiny_model_dir, tmp_path, int_id_rows(rows), tmp_path / "run", output={"rows_per_part": 4}
    )
    first = start(job)
    try:
        wait_for_parts(first, tmp_path / "run", parts=1)
        first.send_signal(signal.SIGSTOP)  # holds the lock, mid-run, for as long as needed
        second = run(job)
        lines_while_stopped = manifest(tmp_path / "run")
    finally:
        first.send_signal(signal.SIGCONT)
    out, _ = first.communicate(timeout=300)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"pid {first.pid} on host {socket.gethostname()}" in second.stderr
    assert "is in use by another batchgen run" in second.stderr
    assert "Traceback" not in second.stderr
    assert first.returncode == 0, out.decode()
    # The refused run wrote nothing: the first one's manifest is its own, line for line.
    assert manifest(tmp_path / "run")[: len(lines_while_stopped)] == lines_while_stopped
    entries = manifest(tmp_path / "run")
    assert len(entries) == len({e["part"] for e in entries}) == 10
    assert sorted(results(tmp_path / "run")["id"].to_list()) == list(range(rows))


def test_lock_is_released_when_its_holder_is_killed(tmp_path):
    run_path = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from batchgen.run_lock import RunLock; "
            f"RunLock({str(run_path)!r}).acquire(); print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(JobError, match=rf"pid {holder.pid} on host"):
            RunLock(run_path).acquire()
        assert held_by(run_path).startswith(f"pid {holder.pid} on host")
    finally:
        holder.kill()  # SIGKILL: no cleanup of any kind runs
        holder.wait()
    assert held_by(run_path) is None
    with RunLock(run_path):  # the OS dropped the lock with its process
        pass
    assert lock_path(run_path) == tmp_path / ".run.lock"


def test_new_run_is_refused_while_locked_and_moves_nothing(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(12))
    progress = Progress(None, tty=False, interval=3600)
    assert run_job(parse_job(job), path, llm=FakeLLM(), progress=progress).exit_code == 0
    before = sorted(p.name for p in (tmp_path / "run" / "results").iterdir())
    job["sampling"]["temperature"] = 0.7
    with RunLock(tmp_path / "run"), pytest.raises(JobError, match="in use by another"):
        run_job(parse_job(job), path, new_run=True, llm=FakeLLM(), progress=progress)
    assert not list(tmp_path.glob("run.*"))  # --new-run moved nothing aside
    assert sorted(p.name for p in (tmp_path / "run" / "results").iterdir()) == before
