"""Resuming a run: the job must still be the same job, committed ids are skipped, and
--retry-errors takes error rows back out of the results so they run again. (What counts as
committed is settled first by run_dir_check.reconcile.)"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.job_spec import JobError, JobSpec
from batchgen.run_dir import RunDir, write_atomic
from batchgen.store_path import read_schema, read_table
from batchgen.writer import commit_part

log = logging.getLogger(__name__)


def _changed_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            changed.extend(_changed_fields(a, b, f"{name}."))
        elif a != b:
            changed.append(name)
    return changed


def check_run_dir(job: JobSpec, new_run: bool) -> None:
    """Refuse (JobError) an output.path holding a run of a job whose output-affecting
    fields changed, unless `new_run`; refuse a non-empty directory that is not a run.
    Reads only: called before the model is loaded."""
    run_dir = RunDir(job.output.path)
    if run_dir.exists():
        if new_run:
            return
        try:
            stored = json.loads(run_dir.job_file.read_text())
        except (OSError, ValueError) as exc:
            raise JobError(
                f"output.path: {run_dir.job_file} cannot be read ({exc}), so the run there "
                "cannot be checked against this job; rerun with --new-run to start over "
                "(the old run is kept aside), or point output.path elsewhere"
            ) from None
        if stored.get("fingerprint") != job.fingerprint:
            changed = _changed_fields(stored.get("fingerprint_fields", {}), _jsonable(job))
            raise JobError(
                f"output.path: {run_dir.path} holds a run of a different job "
                f"(changed: {', '.join(changed) or 'fingerprint'}); its results would not "
                "match. Rerun with --new-run to start over (the old run is kept aside), or "
                "point output.path elsewhere"
            )
    elif run_dir.path.exists() and (not run_dir.path.is_dir() or any(run_dir.path.iterdir())):
        raise JobError(
            f"output.path: {run_dir.path} exists, is not empty and is not a batchgen run "
            "directory; choose another output.path"
        )


def open_run_dir(
    job: JobSpec, new_run: bool, job_path: str | Path | None = None
) -> tuple[RunDir, str | None]:
    """Create the run directory, or reopen the existing one of this job. With `new_run`
    an existing run is moved aside (never deleted) and a fresh one begins.
    Returns the run dir and, when one was moved aside, where it went."""
    check_run_dir(job, new_run)
    run_dir = RunDir(job.output.path)
    archived = None
    if run_dir.exists() and new_run:
        archived = f"{run_dir.path}.{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(run_dir.path, archived)  # a Path: a store refuses --new-run
        log.info("--new-run: moved the previous run to %s", archived)
    run_dir.create()
    if not run_dir.job_file.exists():
        payload = {
            "fingerprint": job.fingerprint,
            "fingerprint_fields": _jsonable(job),
            "job": job.model_dump(),
            "job_path": str(job_path) if job_path else None,
            "created": time.time(),
        }
        write_atomic(run_dir.job_file, json.dumps(payload, indent=2, default=str))
    return run_dir, archived


def _jsonable(job: JobSpec) -> dict:
    return json.loads(json.dumps(job.fingerprint_fields(), default=str))


def committed_ids(run_dir: RunDir) -> tuple[set[str], int, int]:
    """Ids already in live parts, as text (the reader's form: an int id 7 is "7"), with
    their counts of ok and error result rows."""
    ids: set[str] = set()
    ok = error = 0
    for entry in run_dir.live_parts():
        table = read_table(run_dir.results / entry.part, columns=["id"])
        ids.update(str(v) for v in table.column("id").to_pylist())
        ok += entry.ok
        error += entry.error
    return ids, ok, error


def schema_for_run(run_dir: RunDir, schema: pa.Schema) -> pa.Schema:
    """The schema new parts are written with: the job's, except that the id column keeps
    the type the run's committed parts already have, so all parts read as one dataset."""
    live = run_dir.live_parts()
    if not live:
        return schema
    committed = read_schema(run_dir.results / live[0].part).field("id").type
    if committed == schema.field("id").type:
        return schema
    log.info("ids are written as %s, as in the parts this run already committed", committed)
    return schema.set(0, pa.field("id", committed, nullable=False))


def take_back_errors(run_dir: RunDir, fingerprint: str, session: str) -> int:
    """--retry-errors: rewrite every live part that holds error rows without them, each
    committed by a manifest line that `replaces` the old part, which then moves to
    quarantine/. The error rows' ids are no longer committed and run again. Returns how
    many input rows will be retried."""
    retried: set[str] = set()
    next_number = run_dir.next_part_number()
    for entry in run_dir.live_parts():
        if entry.error == 0:
            continue
        path = run_dir.results / entry.part
        table = read_table(path)
        bad_ids = pc.filter(table.column("id"), pc.not_equal(table.column("status"), "ok"))
        bad = set(bad_ids.to_pylist())
        # All n completions of a row go back together, so the row is redone whole.
        keep = table.filter(pc.invert(pc.is_in(table.column("id"), value_set=bad_ids.unique())))
        retried |= bad
        name = f"part-{next_number:05d}.parquet"
        next_number += 1
        commit_part(run_dir, keep, name, fingerprint, session, replaces=entry.part)
        for old in (path, run_dir.errors / entry.part):
            if old.exists():
                run_dir.quarantine(old, f"replaced by {name} (--retry-errors)", session)
    return len(retried)


def resume_command(job_path: str | Path) -> str:
    return f"batchgen run {job_path}"
