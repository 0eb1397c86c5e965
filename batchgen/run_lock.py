"""One run at a time per output directory: an exclusive `flock` held for the whole run.

The lock file sits beside the run directory, `<parent>/.<name>.lock`, not inside it:
`--new-run` renames the run directory aside, and a lock file inside would move with it,
leaving the fresh directory unlocked for a moment. Beside it, one path guards the name
whatever is renamed under it. The OS drops a flock when its process dies, so a `kill -9`
never leaves a stale lock; the file itself stays (removing a lock file while another
process may be opening it would let two processes hold "the" lock).

A run directory on object storage (output.path a URI) has no lock: object stores offer
no exclusive lock that dies with its holder. One driver per run directory is then the
user's to ensure, and the run says so when it starts.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from batchgen.job_spec import JobError
from batchgen.store_path import is_uri

log = logging.getLogger(__name__)

_TRIES = 5


def lock_path(run_path: str | Path) -> Path:
    run = Path(os.path.abspath(run_path))
    return run.with_name(f".{run.name}.lock")


class RunLock:
    """`with RunLock(output.path):` holds the run's lock or raises JobError naming the
    process that holds it."""

    def __init__(self, run_path: str | Path):
        self.run_path = run_path
        self.path = None if is_uri(run_path) else lock_path(run_path)
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if self.path is None:
            log.warning(
                "output.path %s is on object storage, where no run lock exists: make sure "
                "no other batchgen run uses it at the same time",
                self.run_path,
            )
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock_exclusive(fd)
        except BlockingIOError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise JobError(
                f"output.path: {self.run_path} is in use by another batchgen run ({holder}); "
                f"wait for it to finish or stop it (lock file {self.path})"
            ) from None
        except OSError:
            os.close(fd)
            raise
        # Who holds it, for the message a second run prints.
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def _flock_exclusive(fd: int) -> None:
    # A few tries: `held_by` (report --verify) holds a shared lock for an instant; a run
    # holds its lock for the whole run.
    for _ in range(_TRIES - 1):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.05)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def held_by(run_path: str | Path) -> str | None:
    """Who holds the run's lock now ("pid N on host H, since ..."), or None; takes no
    lock and writes nothing (a shared lock is tried and dropped at once)."""
    if is_uri(run_path):
        return None  # object storage: no lock to ask
    try:
        fd = os.open(lock_path(run_path), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(_read_holder(fd))
    finally:
        os.close(fd)
    return None


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if "pid" not in holder:
        return "its holder has not written its name yet"
    since = holder.get("since")
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return f"pid {holder['pid']} on host {holder.get('host', '?')}, since {started}"
