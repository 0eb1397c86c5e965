"""The run directory and its manifest.

    <run>/job.json            the job as run, with its fingerprint
    <run>/results/part-*.parquet
    <run>/errors/part-*.parquet   the error rows of each part, for a quick look
    <run>/_manifest.jsonl      one line per committed part; only parts named here count
    <run>/quarantine/<session>/   what a check moved aside (damaged or unverifiable files,
                                  replaced parts, an old manifest), with reasons.jsonl
    <run>/progress.json, report.json, report.md, report.png, _SUCCESS

A part is committed when its manifest line is on disk (written and fsynced after the part
file itself was renamed into place). The line records the part's rows, bytes and sha256, so
a resume can tell a part is the one committed. A line may name an older part it `replaces`
(--retry-errors rewrites a part without its error rows); the older one no longer counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.store_path import StoreFiles, StorePath, run_path

PART_NAME = re.compile(r"part-(\d+)\.parquet$")


def fsync_dir(path: Path | StorePath) -> None:
    # The rename of a file is durable only once its directory entry is. An object store
    # has no directory entries: an object is durable once written (batchgen.store_path).
    if isinstance(path, StorePath):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(f) -> None:
    """Flush `f` to stable storage (a file opened on a StorePath is uploaded, and so
    durable, when it is closed)."""
    f.flush()
    if not isinstance(f, StoreFiles):
        os.fsync(f.fileno())


def tmp_name(path: Path) -> Path:
    """Where `path` is written before its rename: a hidden name that no `*.parquet` glob
    of the results matches."""
    return path.with_name(f".{path.name}.tmp")


def write_atomic(path: Path, data: bytes | str, durable: bool = True) -> None:
    """Write to a temporary name, fsync, and rename over `path`. On failure the temporary
    file is removed and the error raised: `path` is then unchanged."""
    tmp = tmp_name(path)
    mode = "wb" if isinstance(data, bytes) else "w"
    try:
        with tmp.open(mode) as f:
            f.write(data)
            if durable:
                fsync_file(f)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
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
    # The file as committed. None on lines written before parts were checksummed: such a
    # part is verified by reading it whole instead.
    bytes: int | None = None
    checksum: str | None = None  # "sha256:<hex>"
    # The Ray worker that wrote the part (None: the local executor).
    worker: str | None = None

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if fields["worker"] is None:  # local parts keep the lines they always had
            del fields["worker"]
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> ManifestEntry:
        # Keys this version does not know are ignored, so a line stays readable.
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Manifest:
    """What `_manifest.jsonl` holds. `damaged` lists what is wrong with it beyond a torn
    last line (a crash while appending, which is normal): unreadable lines by number, or
    why the file could not be read at all."""

    exists: bool
    entries: list[ManifestEntry] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)


def live_entries(entries: list[ManifestEntry]) -> list[ManifestEntry]:
    """The parts that count: committed and not replaced by a later line."""
    replaced = {e.replaces for e in entries if e.replaces}
    return [e for e in entries if e.part not in replaced]


def part_number(name: str) -> int | None:
    match = PART_NAME.search(name)
    return int(match.group(1)) if match else None


class RunDir:
    def __init__(self, path: str | Path | StorePath):
        self.path = run_path(path)
        self.results = self.path / "results"
        self.errors = self.path / "errors"
        self.quarantine_dir = self.path / "quarantine"
        self.manifest = self.path / "_manifest.jsonl"
        self.job_file = self.path / "job.json"
        self.progress_file = self.path / "progress.json"
        self.success = self.path / "_SUCCESS"
        self.clusters_file = self.path / "clusters.json"

    def save_engine_choice(self, name: str, summary: dict | None) -> None:
        """What the engine of the latest session decided for itself, for the reports
        (<name>.json): `expert_placement` (LLM.expert_placement; none when every expert
        is on the GPU), `batch_size` (LLM.batch_size_choice; none when the job set
        max_num_seqs)."""
        path = self.path / f"{name}.json"
        if summary is None:
            path.unlink(missing_ok=True)
            return
        write_atomic(path, json.dumps(summary, indent=1) + "\n")

    def engine_choice(self, name: str) -> dict | None:
        path = self.path / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def exists(self) -> bool:
        return self.job_file.exists()

    def create(self) -> None:
        self.results.mkdir(parents=True, exist_ok=True)
        self.errors.mkdir(parents=True, exist_ok=True)

    def read_manifest(self) -> Manifest:
        if not self.manifest.exists():
            return Manifest(exists=False)
        try:
            text = self.manifest.read_bytes().decode("utf-8", errors="replace")
        except OSError as exc:
            return Manifest(exists=True, damaged=[f"cannot be read: {exc}"])
        manifest = Manifest(exists=True)
        lines = text.split("\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                manifest.entries.append(ManifestEntry.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError, AttributeError):
                torn_tail = number == len(lines)  # no newline after it: an unfinished append
                if not torn_tail:
                    manifest.damaged.append(f"line {number} is not a manifest entry")
        return manifest

    def entries(self) -> list[ManifestEntry]:
        """Every readable manifest line, in order."""
        return self.read_manifest().entries

    def live_parts(self) -> list[ManifestEntry]:
        return live_entries(self.entries())

    def append_manifest(self, entry: ManifestEntry) -> None:
        line = entry.to_json() + "\n"
        # Repair a torn last line first so the new line starts on its own.
        size = self.manifest.stat().st_size if self.manifest.exists() else 0
        if size:
            with self.manifest.open("rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    line = "\n" + line
        with self.manifest.open("a") as f:
            f.write(line)
            fsync_file(f)
        fsync_dir(self.path)

    def rewrite_manifest(self, entries: list[ManifestEntry]) -> None:
        write_atomic(self.manifest, "".join(e.to_json() + "\n" for e in entries))

    def next_part_number(self) -> int:
        """One past every part number in use anywhere in the run, quarantine included, so a
        new part never takes the name of one moved aside."""
        numbers = [0]
        files = [*self.results.glob("*part-*"), *self.errors.glob("*part-*")]
        if self.quarantine_dir.exists():
            files += self.quarantine_dir.rglob("*part-*")
        for f in files:
            digits = re.search(r"part-(\d+)", f.name)
            if digits:
                numbers.append(int(digits.group(1)))
        # Names only a quarantined manifest or note still mentions (a part that was
        # missing) are not reused either.
        for note in self._quarantine_notes():
            numbers += [int(n) for n in re.findall(r"part-(\d+)", note.read_text(errors="replace"))]
        for e in self.entries():
            n = part_number(e.part)
            if n is not None:
                numbers.append(n)
        return max(numbers) + 1

    def quarantine(self, path: Path, reason: str, session: str, copy: bool = False) -> Path:
        """Move (or `copy`) `path`, a file of this run, into quarantine/<session>/, keeping
        its place relative to the run directory, and note why. Nothing is ever deleted."""
        target_dir = self.quarantine_dir / session
        target = target_dir / path.relative_to(self.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        stem, suffix = target.name, 1
        while target.exists():
            target = target.with_name(f"{stem}.{suffix}")
            suffix += 1
        if copy and isinstance(path, StorePath):
            path.copy_to(target)
        elif copy:
            shutil.copy2(path, target)
        else:
            path.replace(target)
            fsync_dir(path.parent)
        self.note_quarantine(path, reason, session, moved_to=target)
        return target

    def note_quarantine(
        self, path: Path, reason: str, session: str, moved_to: Path | None = None
    ) -> None:
        """Record in quarantine/<session>/reasons.jsonl what happened to `path` and why
        (`moved_to` None: there was nothing to move, e.g. a part found missing)."""
        target_dir = self.quarantine_dir / session
        target_dir.mkdir(parents=True, exist_ok=True)
        note = {
            "file": str(path.relative_to(self.path)),
            "moved_to": str(moved_to.relative_to(self.path)) if moved_to else None,
            "reason": reason,
            "time": time.time(),
        }
        with (target_dir / "reasons.jsonl").open("a") as f:
            f.write(json.dumps(note) + "\n")
            fsync_file(f)

    def _quarantine_notes(self) -> list[Path]:
        if not self.quarantine_dir.is_dir():
            return []
        return [
            p
            for p in self.quarantine_dir.rglob("*")
            if p.is_file() and (p.name == "reasons.jsonl" or p.name.startswith("_manifest"))
        ]


def new_session_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
