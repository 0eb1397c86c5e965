"""The run directory and its manifest.

    <run>/job.json            the job as run, with its fingerprint
    <run>/results/part-*.parquet
    <run>/errors/part-*.parquet   the error rows of each part, for a quick look
    <run>/_manifest.jsonl      one line per committed part; only parts named here count
    <run>/progress.json, report.json, report.md, report.png, _SUCCESS

A part is committed when its manifest line is on disk (written and fsynced after the part
file itself was renamed into place). A line may name an older part it `replaces`
(--retry-errors rewrites a part without its error rows); the older one no longer counts.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path


def fsync_dir(path: Path) -> None:
    # The rename of a file is durable only once its directory entry is.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str, durable: bool = True) -> None:
    """Write to a temporary name, fsync, and rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(tmp, mode) as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


@dataclass
class ManifestEntry:
    part: str
    rows: int
    ok: int
    error: int
    prompt_tokens: int
    completion_tokens: int
    time: float
    session: str
    replaces: str | None = None


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.results = self.path / "results"
        self.errors = self.path / "errors"
        self.manifest = self.path / "_manifest.jsonl"
        self.job_file = self.path / "job.json"
        self.progress_file = self.path / "progress.json"
        self.success = self.path / "_SUCCESS"
        self.clusters_file = self.path / "clusters.json"

    def exists(self) -> bool:
        return self.job_file.exists()

    def create(self) -> None:
        self.results.mkdir(parents=True, exist_ok=True)
        self.errors.mkdir(parents=True, exist_ok=True)

    def entries(self) -> list[ManifestEntry]:
        """Every committed manifest line, in order. A torn last line (a crash while
        appending) is ignored: its part was never committed."""
        if not self.manifest.exists():
            return []
        out = []
        for line in self.manifest.read_text().splitlines():
            try:
                out.append(ManifestEntry(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue
        return out

    def live_parts(self) -> list[ManifestEntry]:
        """The parts that count: committed and not replaced by a later one."""
        entries = self.entries()
        replaced = {e.replaces for e in entries if e.replaces}
        return [e for e in entries if e.part not in replaced]

    def append_manifest(self, entry: ManifestEntry) -> None:
        line = json.dumps(entry.__dict__, separators=(",", ":")) + "\n"
        # Repair a torn last line first so the new line starts on its own.
        if self.manifest.exists() and self.manifest.stat().st_size:
            with open(self.manifest, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
        with open(self.manifest, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.path)

    def next_part_number(self) -> int:
        numbers = [0]
        for d in (self.results, self.errors):
            for f in d.glob("*part-*.parquet*"):
                digits = "".join(ch for ch in f.name.split("part-")[1] if ch.isdigit())
                if digits:
                    numbers.append(int(digits))
        for e in self.entries():
            numbers.append(int("".join(ch for ch in e.part if ch.isdigit())))
        return max(numbers) + 1

    def remove_orphans(self) -> list[str]:
        """Delete part files that no live manifest line names: a part written but not
        committed when the process died, temporary files, replaced parts."""
        live = {e.part for e in self.live_parts()}
        removed = []
        for d in (self.results, self.errors):
            if not d.exists():
                continue
            for f in d.iterdir():
                if f.name not in live:
                    f.unlink()
                    removed.append(str(f.relative_to(self.path)))
        return removed


def new_session_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
