"""An OS error writing a part (here a real one: EFBIG from RLIMIT_FSIZE, as a full disk
gives ENOSPC) stops the run with one line naming the file and the errno, exit 5, no
temporary file left behind; the committed parts stay whole and the rerun completes."""

from __future__ import annotations

import os
import re
import resource

from click.testing import CliRunner

from batchgen.cli import main
from tests.batchgen.run_process import int_id_rows, job_file, manifest, results, run

ROWS = 40
LIMIT = 256 * 1024  # bytes any one file of the run may reach


def _limit_file_size() -> None:
    # In the child before exec: writes past LIMIT fail with EFBIG (Python ignores SIGXFSZ).
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def test_os_error_writing_a_part_stops_resumably(tiny_model_dir, tmp_path):
    # Rows from 30 on carry 64 KB of incompressible text each: a part holding them outgrows
    # LIMIT. Windows of 10 rows keep them out of the first parts.
    rows = int_id_rows(ROWS, blob=lambda i: os.urandom(32 * 1024).hex() if i >= 30 else "")
    run_path = tmp_path / "run"
    job = job_file(tiny_model_dir, tmp_path, rows, run_path, batching={"plan_window": 10})
    stopped = run(job, preexec_fn=_limit_file_size)
    assert stopped.returncode == 5, stopped.stdout + stopped.stderr
    assert "Traceback" not in stopped.stderr
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stopped.stderr
    match = re.match(
        rf"error: writing {re.escape(str(run_path))}/results/part-(\d+)\.parquet failed: "
        r"\[Errno 27\] File too large; .* resume with `batchgen run (.*)`$",
        errors[0],
    )
    assert match and match.group(2) == str(job), errors[0]
    failed = int(match.group(1))
    assert failed >= 2  # at least one part was committed before
    assert not [p for p in run_path.rglob("*") if p.name.endswith(".tmp")]
    # The parts before the failed one are committed and whole.
    assert [e["part"] for e in manifest(run_path)] == [
        f"part-{n:05d}.parquet" for n in range(1, failed)
    ]
    verify = CliRunner().invoke(main, ["report", str(run_path), "--verify"])
    assert verify.exit_code == 0, verify.output

    rerun = run(job)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(results(run_path)["id"].to_list()) == list(range(ROWS))
