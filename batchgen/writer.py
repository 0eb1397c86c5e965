"""Result parts: an explicit Arrow schema, written as tmp file -> fsync -> rename, then one
manifest line with the file's size and sha256. Errors are mirrored to errors/ before the
manifest line, so a committed part always has its mirror. Each part carries its own
manifest line and the job fingerprint in its Parquet metadata (see part_check.py)."""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.part_check import METADATA_KEY, file_checksum, part_metadata
from batchgen.rows import ResultRow
from batchgen.run_dir import ManifestEntry, RunDir, fsync_dir, fsync_file, tmp_name

_TOP_LOGPROB_FIELDS = [
    pa.field("token", pa.string()),
    pa.field("token_id", pa.int32()),
    pa.field("bytes", pa.binary()),
    pa.field("logprob", pa.float64()),
]
LOGPROB_STRUCT = pa.struct(
    [*_TOP_LOGPROB_FIELDS, pa.field("top_logprobs", pa.list_(pa.struct(_TOP_LOGPROB_FIELDS)))]
)

RESULT_FIELDS = [
    # The id's type is the input id column's (see result_schema); string is the default.
    pa.field("id", pa.string(), nullable=False),
    pa.field("n_index", pa.int32(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("text", pa.large_string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    # prompt tokens the engine read from its prefix cache instead of computing
    pa.field("cached_prompt_tokens", pa.int32()),
    pa.field("cluster_id", pa.int32()),
    pa.field("error", pa.string()),
    pa.field("error_type", pa.string()),
    pa.field("seed", pa.int64()),
    # per generated token, null unless the job asks for sampling.logprobs
    pa.field("logprobs", pa.list_(LOGPROB_STRUCT)),
    pa.field("model", pa.string()),
    pa.field("job_fingerprint", pa.string()),
]
RESERVED_COLUMNS = {f.name for f in RESULT_FIELDS}


def output_column_for(input_column: str) -> str:
    """Carried input columns keep their name unless it clashes with a result column
    (translate inputs often have `text`): then they are written as `input_<name>`."""
    return f"input_{input_column}" if input_column in RESERVED_COLUMNS else input_column


def result_schema(carry_fields: list[pa.Field], id_type: pa.DataType | None = None) -> pa.Schema:
    fields = list(RESULT_FIELDS)
    if id_type is not None:
        fields[0] = pa.field("id", id_type, nullable=False)
    return pa.schema(fields + carry_fields)


def typed_ids(ids: list[str], id_type: pa.DataType) -> list:
    """Rows carry their id as text (one kind of key for sets and seeds); the result column
    gets the input's integer type back. str(int) -> int round-trips exactly."""
    if pa.types.is_integer(id_type):
        return [int(i) for i in ids]
    return ids


class PartWriteError(Exception):
    """The OS refused a write of a part or its manifest line (disk full, I/O error,
    permission). Nothing of that part was committed and no temporary file is left; the
    run resumes once the cause is fixed."""

    def __init__(self, path: Path, cause: OSError):
        self.path = path
        self.cause = cause
        reason = f"[Errno {cause.errno}] {cause.strerror}" if cause.errno else str(cause)
        super().__init__(f"writing {path} failed: {reason}")


def write_part_file(table: pa.Table, path: Path) -> tuple[int, str]:
    """Write a Parquet part durably: tmp file -> fsync -> rename -> fsync the directory, so
    a kill -9 leaves either the whole part or a tmp file, never a torn part. Returns the
    file's size and checksum. An OS error removes the tmp file and raises PartWriteError."""
    tmp = tmp_name(path)
    try:
        with tmp.open("wb") as f:
            pq.write_table(table, f, compression="zstd")
            fsync_file(f)
        # Hashed from the tmp file before the rename: the manifest's checksum is of what
        # the disk (or the object store) holds.
        size, checksum = tmp.stat().st_size, file_checksum(tmp)
        tmp.replace(path)
        fsync_dir(path.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise PartWriteError(path, exc) from exc
        raise
    return size, checksum


def _sum(table: pa.Table, column: str, mask=None) -> int:
    col = table.column(column) if mask is None else pc.filter(table.column(column), mask)
    return int(pc.sum(col).as_py() or 0) if len(col) else 0


def entry_for(
    table: pa.Table, name: str, session: str, replaces: str | None = None
) -> ManifestEntry:
    """The manifest line of a part holding `table` (size and checksum come once it is
    written)."""
    ok = int(pc.sum(pc.equal(table.column("status"), "ok")).as_py() or 0)
    return ManifestEntry(
        part=name,
        rows=table.num_rows,
        ok=ok,
        error=table.num_rows - ok,
        prompt_tokens=_sum(table, "prompt_tokens", pc.equal(table.column("n_index"), 0)),
        completion_tokens=_sum(table, "completion_tokens"),
        time=time.time(),
        session=session,
        replaces=replaces,
    )


def write_part(
    table: pa.Table,
    name: str,
    fingerprint: str,
    session: str,
    results_dir: Path,
    errors_dir: Path,
    replaces: str | None = None,
    worker: str | None = None,
) -> ManifestEntry:
    """Write `table` durably as results_dir/<name> (and its error rows as
    errors_dir/<name>) and return its manifest line, not yet appended: the part counts
    only once its line is. Raises PartWriteError."""
    entry = entry_for(table, name, session, replaces)
    entry.worker = worker
    metadata = {**(table.schema.metadata or {}), **part_metadata(entry, fingerprint)}
    entry.bytes, entry.checksum = write_part_file(
        table.replace_schema_metadata(metadata), results_dir / name
    )
    if entry.error:
        write_error_rows(errors_dir, table, name)
    return entry


def commit_part(
    run_dir: RunDir,
    table: pa.Table,
    name: str,
    fingerprint: str,
    session: str,
    replaces: str | None = None,
) -> ManifestEntry:
    """Write `table` as results/<name> (and its error rows as errors/<name>), then append
    its manifest line: the part counts from that line on. Raises PartWriteError."""
    entry = write_part(table, name, fingerprint, session, run_dir.results, run_dir.errors, replaces)
    try:
        run_dir.append_manifest(entry)
    except OSError as exc:
        raise PartWriteError(run_dir.manifest, exc) from exc
    return entry


def write_error_mirror(run_dir: RunDir, table: pa.Table, name: str) -> None:
    """errors/<name>: the error rows of part <name>, a copy for a quick look (never read
    back as results, so without the part's own metadata)."""
    write_error_rows(run_dir.errors, table, name)


def write_error_rows(errors_dir: Path, table: pa.Table, name: str) -> None:
    errors = table.filter(pc.not_equal(table.column("status"), "ok"))
    kept = {k: v for k, v in (errors.schema.metadata or {}).items() if k != METADATA_KEY}
    write_part_file(errors.replace_schema_metadata(kept), errors_dir / name)


def results_table(
    rows: list[ResultRow], schema: pa.Schema, model: str, fingerprint: str
) -> pa.Table:
    """Result rows as a table of the run's schema (carried columns by their output name)."""
    columns = {
        "id": typed_ids([r.id for r in rows], schema.field("id").type),
        "n_index": [r.n_index for r in rows],
        "status": [r.status for r in rows],
        "text": [r.text for r in rows],
        "finish_reason": [r.finish_reason for r in rows],
        "prompt_tokens": [r.prompt_tokens for r in rows],
        "completion_tokens": [r.completion_tokens for r in rows],
        "cached_prompt_tokens": [r.cached_prompt_tokens for r in rows],
        "cluster_id": [r.cluster_id for r in rows],
        "error": [r.error for r in rows],
        "error_type": [r.error_type for r in rows],
        "seed": [r.seed for r in rows],
        "logprobs": [r.logprobs for r in rows],
        "model": [model] * len(rows),
        "job_fingerprint": [fingerprint] * len(rows),
    }
    for name in schema.names:
        if name not in RESERVED_COLUMNS:
            columns[name] = [r.carry.get(name) for r in rows]
    return pa.Table.from_pydict(columns, schema=schema)


class PartWriter:
    """Collects finished rows and writes a part every `rows_per_part` rows.

    With `in_input_order`, rows are released in input order: `expect(seq)` is called for
    every row sent onward, in input order, and a row is held until every earlier expected
    row has finished. The hold is bounded by what the engine has in flight plus the
    planner's window."""

    def __init__(
        self,
        run_dir: RunDir,
        schema: pa.Schema,
        rows_per_part: int,
        model: str,
        fingerprint: str,
        session: str,
        in_input_order: bool = False,
        on_commit: Callable[[ManifestEntry], None] | None = None,
    ):
        self.run_dir = run_dir
        self.schema = schema
        self.rows_per_part = rows_per_part
        self.model = model
        self.fingerprint = fingerprint
        self.session = session
        self.in_input_order = in_input_order
        self.on_commit = on_commit
        self.buffer: list[ResultRow] = []
        self._expected: deque[int] = deque()
        self._held: list[tuple[int, int, ResultRow]] = []  # heap of (seq, n_index, row)
        self._next_part = run_dir.next_part_number()
        self.parts_written: list[str] = []
        # Set by the first failed write; the writer then writes nothing more (what it
        # holds was never committed and runs again on resume).
        self.failed: PartWriteError | None = None

    def expect(self, seq: int) -> None:
        if self.in_input_order:
            self._expected.append(seq)

    def add(self, rows: Iterable[ResultRow]) -> None:
        """Add all the result rows of one input row (its n completions) together, so a
        row is always committed whole."""
        if self.failed is not None:
            raise self.failed
        if not self.in_input_order:
            self.buffer.extend(rows)
        else:
            for r in rows:
                heapq.heappush(self._held, (r.seq, r.n_index, r))
            self._release_in_order()
        # The buffer only ever holds whole input rows, so a part never splits the n
        # completions of one row.
        if len(self.buffer) >= self.rows_per_part:
            self._write_part(self._take_buffer())

    def _release_in_order(self) -> None:
        while self._expected and self._held and self._held[0][0] == self._expected[0]:
            seq = self._expected.popleft()
            while self._held and self._held[0][0] == seq:
                self.buffer.append(heapq.heappop(self._held)[2])

    def flush(self) -> None:
        """Write what is buffered as a (possibly short) part (nothing after a failed
        write)."""
        if self.failed is not None:
            return
        if self.in_input_order:
            # At the end (or on interrupt) rows still held are written in order anyway;
            # their missing predecessors were never sent and will be redone on resume.
            while self._held:
                self.buffer.append(heapq.heappop(self._held)[2])
            self._expected.clear()
        if self.buffer:
            self._write_part(self._take_buffer())

    def commit_ready(self) -> None:
        """Write the rows released so far as a (possibly short) part; rows held for input
        order stay held (their predecessors are still running). After an engine fault,
        so that what finished is on disk before the engine is rebuilt."""
        if self.failed is None and self.buffer:
            self._write_part(self._take_buffer())

    def _take_buffer(self) -> list[ResultRow]:
        # Out of the buffer before the write: a write interrupted after its manifest line
        # (a signal lands between any two bytecodes) must not leave its rows to be
        # written again. A write that fails leaves its rows uncommitted: they run again
        # on resume.
        rows, self.buffer = self.buffer, []
        return rows

    def _table(self, rows: list[ResultRow]) -> pa.Table:
        return results_table(rows, self.schema, self.model, self.fingerprint)

    def _write_part(self, rows: list[ResultRow]) -> None:
        name = f"part-{self._next_part:05d}.parquet"
        self._next_part += 1
        try:
            entry = commit_part(
                self.run_dir, self._table(rows), name, self.fingerprint, self.session
            )
        except PartWriteError as exc:
            self.failed = exc
            raise
        self.parts_written.append(name)
        if self.on_commit is not None:
            self.on_commit(entry)
