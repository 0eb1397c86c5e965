"""Checking one result part: its checksum against its manifest line, its own Parquet
metadata, and a full read.

Every part carries, in its Parquet key-value metadata under `batchgen.part`, the job
fingerprint and everything its manifest line holds but the file's own bytes and checksum
(rows, ok/error counts, tokens, session, `replaces`). So a part proves by itself which job
and which line it belongs to, and a lost manifest can be rebuilt from the parts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from batchgen.run_dir import ManifestEntry
from batchgen.store_path import read_metadata, read_table

METADATA_KEY = b"batchgen.part"
_CHUNK = 1 << 20


def file_checksum(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def part_metadata(entry: ManifestEntry, fingerprint: str) -> dict[bytes, bytes]:
    """The key-value metadata a part is written with (its line, less bytes and checksum,
    which only exist once the file does)."""
    fields = {k: v for k, v in entry.__dict__.items() if k not in ("bytes", "checksum")}
    if fields.get("worker") is None:
        fields.pop("worker", None)
    return {METADATA_KEY: json.dumps({"fingerprint": fingerprint, **fields}).encode()}


@dataclass
class PartMeta:
    fingerprint: str | None
    entry: ManifestEntry


class PartDamaged(Exception):
    """A part that is not what was committed, or cannot be read; the message says why."""


def read_whole(path: Path) -> pa.Table:
    """Read every column of every row group: a part that reads here can be read by
    `polars.read_parquet` too. Raises PartDamaged with the reader's reason."""
    try:
        return read_table(path)
    except FileNotFoundError:
        raise PartDamaged("missing") from None
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise PartDamaged(f"unreadable ({_first_line(exc)})") from None


def check_committed(path: Path, entry: ManifestEntry) -> None:
    """Raise PartDamaged unless `path` is the part `entry` committed: same size and
    checksum, or, for a line written without them, a full read giving its row count."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise PartDamaged("missing") from None
    except OSError as exc:
        raise PartDamaged(f"cannot be read ({exc})") from None
    if entry.checksum is None:
        rows = read_whole(path).num_rows
        if rows != entry.rows:
            raise PartDamaged(f"holds {rows} rows, its manifest line says {entry.rows}")
        return
    if size != entry.bytes:
        raise PartDamaged(f"{size} bytes, committed as {entry.bytes}{_read_verdict(path)}")
    try:
        checksum = file_checksum(path)
    except OSError as exc:
        raise PartDamaged(f"cannot be read ({exc})") from None
    if checksum != entry.checksum:
        raise PartDamaged(f"checksum differs from the committed one{_read_verdict(path)}")


def _read_verdict(path: Path) -> str:
    # The bytes are not the committed ones either way; the read says how bad it is.
    try:
        read_whole(path)
    except PartDamaged as exc:
        return f"; {exc}"
    return "; it still reads, but its content changed since it was committed"


def read_meta(path: Path) -> PartMeta | None:
    """The part's own `batchgen.part` metadata, or None when it has none (a part written
    before parts carried it). Raises PartDamaged when the footer cannot be read."""
    try:
        kv = read_metadata(path).metadata or {}
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise PartDamaged(f"unreadable ({_first_line(exc)})") from None
    raw = kv.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        fingerprint = data.pop("fingerprint", None)
        return PartMeta(fingerprint, ManifestEntry.from_dict(data))
    except (json.JSONDecodeError, TypeError, AttributeError):
        raise PartDamaged("its batchgen metadata is not readable") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
