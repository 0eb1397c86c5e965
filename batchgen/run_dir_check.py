"""Checking a run directory against its manifest: before every resume, and for
`batchgen report --verify`.

`survey` looks at every file and changes nothing. `reconcile` acts on a survey under the
run lock: it moves what cannot count into quarantine/ (a part is never deleted), adopts the
uncommitted parts that verify, repairs or rebuilds the manifest, and says on stderr what it
did. The ids of a part that does not count are no longer committed, so they run again.

A committed part counts when its file has the size and checksum of its manifest line (a
line written without them: the file reads whole, with its row count) and it holds no id
that an earlier part holds. A part in results/ that no line names (the process stopped
before appending its line, or the manifest was lost) is adopted when it reads whole, its own
metadata names this job and this file, and its ids are not committed; anything else goes to
quarantine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.part_check import PartDamaged, check_committed, file_checksum, read_meta, read_whole
from batchgen.run_dir import Manifest, ManifestEntry, RunDir, live_entries, part_number
from batchgen.store_path import read_table
from batchgen.writer import entry_for, write_error_mirror

log = logging.getLogger(__name__)

_TMP_PART = re.compile(r"^\.part-\d+\.parquet\.tmp$")


@dataclass
class Survey:
    manifest: Manifest
    lines: list[ManifestEntry] = field(default_factory=list)  # readable, one per part name
    verified: list[ManifestEntry] = field(default_factory=list)  # live, as committed
    damaged: list[tuple[ManifestEntry, str]] = field(default_factory=list)  # live, not
    adopted: list[ManifestEntry] = field(default_factory=list)  # uncommitted, verify
    replaced: list[Path] = field(default_factory=list)  # a counted part replaces them
    unverifiable: list[tuple[Path, str]] = field(default_factory=list)
    partial: list[Path] = field(default_factory=list)  # our own tmp files: unfinished writes
    upgraded: bool = False  # a verified line had no checksum: the rewrite adds it
    duplicate_lines: bool = False  # two lines name one part

    @property
    def parts(self) -> list[ManifestEntry]:
        """The parts that count once the survey is acted on."""
        return self.verified + self.adopted

    @property
    def manifest_lost(self) -> bool:
        return not self.manifest.exists and bool(self.adopted or self.unverifiable)

    @property
    def clean(self) -> bool:
        """Nothing to repair: the manifest is whole and results/ holds exactly its parts."""
        return not (
            self.damaged
            or self.adopted
            or self.replaced
            or self.unverifiable
            or self.manifest.damaged
            or self.duplicate_lines
        )


def survey(run_dir: RunDir, fingerprint: str) -> Survey:
    """Classify every part and stray file of the run; changes nothing."""
    manifest = run_dir.read_manifest()
    by_name = {e.part: e for e in manifest.entries}  # a repeated name: the last line wins
    found = Survey(manifest, lines=list(by_name.values()))
    found.duplicate_lines = len(by_name) < len(manifest.entries)
    owner: dict[str, str] = {}  # id -> the counted part holding it
    live = live_entries(found.lines)
    for entry in sorted(live, key=lambda e: part_number(e.part) or 0):
        path = run_dir.results / entry.part
        try:
            check_committed(path, entry)
            ids = _ids(path)
        except PartDamaged as exc:
            found.damaged.append((entry, str(exc)))
            continue
        taken = next((i for i in ids if i in owner), None)
        if taken is not None:
            found.damaged.append((entry, f"holds ids {owner[taken]} holds (e.g. {taken!r})"))
            continue
        owner.update(dict.fromkeys(ids, entry.part))
        if entry.checksum is None:
            found.upgraded = True
            size, checksum = path.stat().st_size, file_checksum(path)
            entry = dataclasses.replace(entry, bytes=size, checksum=checksum)
        found.verified.append(entry)

    live_names = {e.part for e in live}
    replaced_names = {e.replaces for e in found.lines if e.replaces}
    candidates: list[Path] = []
    for path in _files(run_dir.results):
        if _TMP_PART.match(path.name):
            found.partial.append(path)
        elif path.name in live_names or not path.name.endswith(".parquet"):
            continue  # a live part (checked above), or not a file of ours
        elif path.name in replaced_names:
            found.replaced.append(path)
        else:
            candidates.append(path)
    candidates.sort(key=lambda p: (part_number(p.name) is None, part_number(p.name) or 0))
    for path in candidates:
        reason = _adopt(path, fingerprint, owner, found)
        if reason is not None:
            found.unverifiable.append((path, reason))

    counted = {e.part for e in found.parts}
    for path in _files(run_dir.errors):
        if _TMP_PART.match(path.name):
            found.partial.append(path)
        elif path.name.endswith(".parquet") and path.name not in counted:
            found.unverifiable.append((path, "the error mirror of a part that does not count"))
    return found


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []


def _ids(path: Path) -> list[str]:
    """The distinct ids of a part, as text, as the reader yields them (int 7 is "7")."""
    try:
        column = read_table(path, columns=["id"]).column("id")
    except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
        raise PartDamaged(f"its id column cannot be read ({exc})") from None
    return [str(v) for v in pc.unique(column).to_pylist()]


def _adopt(path: Path, fingerprint: str, owner: dict[str, str], found: Survey) -> str | None:
    """Add `path` to `found.adopted`, or return why it cannot count."""
    try:
        table = read_whole(path)
        meta = read_meta(path)
    except PartDamaged as exc:
        return str(exc)
    if meta is not None:
        if meta.fingerprint != fingerprint:
            return f"written by another job (fingerprint {meta.fingerprint})"
        entry = meta.entry
        if entry.part != path.name:
            return f"its metadata names it {entry.part}"
        if entry.rows != table.num_rows:
            return f"holds {table.num_rows} rows, its metadata says {entry.rows}"
    else:
        # A part written before parts carried metadata: its job_fingerprint column says
        # which job wrote every row.
        if "job_fingerprint" not in table.column_names or part_number(path.name) is None:
            return "no batchgen metadata: not a part of this run"
        written_by = pc.unique(table.column("job_fingerprint")).to_pylist()
        if written_by != [fingerprint]:
            return f"written by another job (job_fingerprint {written_by[:2]})"
        entry = entry_for(table, path.name, session="unknown")
    ids = [str(v) for v in pc.unique(table.column("id")).to_pylist()]
    replaces = entry.replaces if entry.replaces in {e.part for e in found.parts} else None
    if replaces is not None:
        # A --retry-errors rewrite whose line was never appended: it holds only ids of the
        # part it replaces, which then stops counting.
        if any(owner.get(i) != replaces for i in ids):
            return f"holds ids that {replaces}, the part it replaces, does not"
        for i in [i for i, part in owner.items() if part == replaces]:
            del owner[i]
        old = next(e for e in found.parts if e.part == replaces)
        (found.verified if old in found.verified else found.adopted).remove(old)
        found.replaced.append(path.parent / replaces)
    else:
        taken = next((i for i in ids if i in owner), None)
        if taken is not None:
            return f"holds ids {owner[taken]} holds (e.g. {taken!r})"
    owner.update(dict.fromkeys(ids, entry.part))
    entry.bytes, entry.checksum = path.stat().st_size, file_checksum(path)
    found.adopted.append(entry)
    return None


def reconcile(run_dir: RunDir, fingerprint: str, session: str) -> Survey:
    """Make the run directory consistent before a session writes to it (under the run
    lock). Files move first and the manifest changes last, so a crash in between leaves
    a state the next reconcile handles the same way."""
    found = survey(run_dir, fingerprint)
    for path in found.partial:
        # A tmp file is a write that never reached its rename: incomplete by construction,
        # and its rows were never committed.
        path.unlink(missing_ok=True)
        log.info("removed %s (a part write that never finished)", _rel(run_dir, path))
    for entry, reason in found.damaged:
        where = ""
        path = run_dir.results / entry.part
        if path.exists():
            where = f"; moved to {_rel(run_dir, run_dir.quarantine(path, reason, session))}"
        else:
            run_dir.note_quarantine(path, reason, session)
        log.warning(
            "part %s is damaged: %s%s; its %d result rows run again",
            entry.part,
            reason,
            where,
            entry.rows,
        )
    for path, reason in found.unverifiable:
        moved = run_dir.quarantine(path, reason, session)
        log.warning(
            "%s does not count (%s): moved to %s", _rel(run_dir, path), reason, _rel(run_dir, moved)
        )
    for path in found.replaced:
        for stale in (path, run_dir.errors / path.name):
            if stale.exists():
                run_dir.quarantine(stale, "replaced by a --retry-errors rewrite", session)
    for entry in found.adopted:
        if entry.error and not (run_dir.errors / entry.part).exists():
            write_error_mirror(run_dir, read_whole(run_dir.results / entry.part), entry.part)

    if found.manifest_lost:
        log.warning(
            "%s is missing: rebuilt it from the %d parts whose own metadata verifies "
            "(%d result rows kept, none regenerated)",
            run_dir.manifest.name,
            len(found.adopted),
            sum(e.rows for e in found.adopted),
        )
    else:
        for entry in found.adopted:
            log.warning(
                "part %s was written but its manifest line was not (the process stopped in "
                "between); it verifies, so its %d rows count",
                entry.part,
                entry.rows,
            )
    for problem in found.manifest.damaged:
        log.warning(
            "%s: %s; repaired it from the parts that verify", run_dir.manifest.name, problem
        )

    if found.damaged or found.manifest.damaged or found.upgraded or found.duplicate_lines:
        _rewrite_manifest(run_dir, found, session)
    else:
        for entry in found.adopted:
            run_dir.append_manifest(entry)
    return found


def _rewrite_manifest(run_dir: RunDir, found: Survey, session: str) -> None:
    """Keep every line that still holds (replaced parts' lines too: the report's timeline
    reads them), drop the lines of parts that no longer count, add the adopted parts. The
    manifest as it was is kept in quarantine."""
    counted = {e.part: e for e in found.parts}
    kept = [counted.get(e.part, e) for e in found.lines] + found.adopted
    # A line that would be live but names a part that does not count goes; dropping a
    # replacing line can bring the line of the part it replaced back to life: repeat.
    while stale := [e for e in live_entries(kept) if e.part not in counted]:
        kept = [e for e in kept if e not in stale]
    if run_dir.manifest.exists():
        try:
            run_dir.quarantine(
                run_dir.manifest, "the manifest before its repair", session, copy=True
            )
        except OSError as exc:
            log.warning("could not keep a copy of the old manifest: %s", exc)
    run_dir.rewrite_manifest(kept)


def _rel(run_dir: RunDir, path: Path) -> str:
    return str(path.relative_to(run_dir.path))


def verify(run_dir: RunDir) -> tuple[list[str], bool]:
    """`batchgen report --verify`: the survey as lines to print, and whether the run
    directory is whole (every committed part as committed, nothing else in results/, the
    manifest readable). Changes nothing."""
    lines: list[str] = []
    try:
        stored = json.loads(run_dir.job_file.read_text())
    except (OSError, ValueError) as exc:
        stored = {}
        lines.append(f"{run_dir.job_file.name}: unreadable ({exc}): no part can be adopted")
    found = survey(run_dir, stored.get("fingerprint"))
    lines += [f"{e.part}: ok ({e.rows:,} rows)" for e in found.verified]
    lines += [f"{e.part}: DAMAGED: {reason}" for e, reason in found.damaged]
    if not found.manifest.exists:
        lines.append(f"{run_dir.manifest.name}: MISSING")
    lines += [f"{run_dir.manifest.name}: DAMAGED: {p}" for p in found.manifest.damaged]
    if found.duplicate_lines:
        lines.append(f"{run_dir.manifest.name}: DAMAGED: two lines name the same part")
    lines += [
        f"{e.part}: NOT COMMITTED: it verifies by its own metadata; a rerun adopts it"
        for e in found.adopted
    ]
    lines += [
        f"{_rel(run_dir, p)}: REPLACED: a rerun moves it to quarantine/" for p in found.replaced
    ]
    lines += [
        f"{_rel(run_dir, p)}: DOES NOT COUNT: {reason}; a rerun moves it to quarantine/"
        for p, reason in found.unverifiable
    ]
    lines += [f"{_rel(run_dir, p)}: an unfinished write; a rerun removes it" for p in found.partial]
    rows = sum(e.rows for e in found.verified)
    if found.clean and found.manifest.exists and stored:
        lines.append(f"verified: {len(found.verified)} parts, {rows:,} result rows, as committed")
        return lines, True
    bad = [e.part for e, _ in found.damaged]
    lines.append(
        f"NOT VERIFIED: {len(found.verified)} parts ({rows:,} result rows) verify"
        + (f"; damaged or missing: {', '.join(bad)}" if bad else "")
        + f"; rerun `batchgen run {stored.get('job_path') or 'JOB'}` to repair and "
        "regenerate (nothing is deleted: what cannot count goes to quarantine/)"
    )
    return lines, False
