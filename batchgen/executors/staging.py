"""Parts written by Ray workers, and how the driver commits them.

    <run>/staging/<worker>/part-N.parquet          a worker's part, durable, not counted
    <run>/staging/<worker>/errors/part-N.parquet   its error rows
    <run>/workers/<worker>.json                    the worker's pid and host

A worker writes its block's part under its own directory (the worker key is unique per
actor process: host, pid and a random tag), tmp -> fsync -> rename, exactly as the local
writer does, and returns the part's manifest line to the driver. Only the driver commits:
it checks the file against the line (size and sha256), renames it into results/ (the
error mirror first), and appends the line to _manifest.jsonl. So "exactly once" has one
writer, and a part no driver recorded never reaches results/.

What the driver never recorded (a worker killed after writing, a retried task's second
copy, everything in flight when a driver was killed) is moved to quarantine/ by the next
driver before it plans any work, and by this one when its session ends: never deleted,
never counted. A kill between the rename into results/ and the manifest line leaves a
part the run directory check adopts (its own metadata names this job and this file).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from batchgen.part_check import check_committed
from batchgen.run_dir import ManifestEntry, RunDir, fsync_dir

log = logging.getLogger(__name__)

STAGING = "staging"
WORKERS = "workers"


def new_worker_key() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def staging_dir(run_dir: RunDir, worker: str) -> Path:
    return run_dir.path / STAGING / worker


def register_worker(run_dir: RunDir, worker: str) -> None:
    """workers/<worker>.json: where the worker runs, for a person (or a test) who wants
    to find its process."""
    directory = run_dir.path / WORKERS
    directory.mkdir(exist_ok=True)
    info = {"worker": worker, "pid": os.getpid(), "host": socket.gethostname()}
    path = directory / f"{worker}.json"
    tmp = directory / f".{worker}.json.tmp"
    tmp.write_text(json.dumps({**info, "started": time.time()}))
    tmp.replace(path)


def commit_staged(run_dir: RunDir, worker: str, entry: ManifestEntry) -> None:
    """Move a worker's part into results/ and append its manifest line. Raises
    PartDamaged when the staged file is not the part the worker reported."""
    source = staging_dir(run_dir, worker)
    check_committed(source / entry.part, entry)
    if entry.error:
        (source / "errors" / entry.part).replace(run_dir.errors / entry.part)
        fsync_dir(run_dir.errors)
    (source / entry.part).replace(run_dir.results / entry.part)
    fsync_dir(run_dir.results)
    run_dir.append_manifest(entry)


def set_aside(run_dir: RunDir, worker: str, part: str, reason: str, session: str) -> None:
    """Quarantine one staged part (and its error rows) that will not be committed."""
    source = staging_dir(run_dir, worker)
    for path in (source / part, source / "errors" / part):
        if path.exists():
            run_dir.quarantine(path, reason, session)


def set_aside_unrecorded(run_dir: RunDir, session: str) -> int:
    """Quarantine every staged part left in staging/ (the driver never recorded it);
    remove the tmp files of writes that never finished. Returns the parts moved."""
    root = run_dir.path / STAGING
    if not root.is_dir():
        return 0
    moved = 0
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.name.startswith(".") and path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)  # incomplete by construction, never committed
            continue
        run_dir.quarantine(
            path, "a Ray worker's part that no driver recorded: its rows run again", session
        )
        moved += path.parent.name != "errors"
    for directory in [*sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True), root]:
        if not any(directory.iterdir()):
            directory.rmdir()
    if moved:
        log.warning(
            "%d part(s) that Ray workers wrote but no driver recorded moved to quarantine/%s; "
            "their rows run again",
            moved,
            session,
        )
    return moved
