"""Result parts: an explicit Arrow schema, written as tmp file -> fsync -> rename, then one
manifest line. Errors are mirrored to errors/ before the manifest line, so a committed part
always has its mirror."""

from __future__ import annotations

import heapq
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.rows import ResultRow
from batchgen.run_dir import ManifestEntry, RunDir, fsync_dir

RESULT_FIELDS = [
    pa.field("id", pa.string(), nullable=False),
    pa.field("n_index", pa.int32(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("text", pa.large_string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("cluster_id", pa.int32()),
    pa.field("error", pa.string()),
    pa.field("error_type", pa.string()),
    pa.field("seed", pa.int64()),
    pa.field("model", pa.string()),
    pa.field("job_fingerprint", pa.string()),
]
RESERVED_COLUMNS = {f.name for f in RESULT_FIELDS}


def output_column_for(input_column: str) -> str:
    """Carried input columns keep their name unless it clashes with a result column
    (translate inputs often have `text`): then they are written as `input_<name>`."""
    return f"input_{input_column}" if input_column in RESERVED_COLUMNS else input_column


def result_schema(carry_fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(RESULT_FIELDS + carry_fields)


def write_part_file(table: pa.Table, path: Path) -> None:
    """Write a Parquet part durably: tmp file -> fsync -> rename -> fsync the directory, so
    a kill -9 leaves either the whole part or an orphan tmp file, never a torn part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        pq.write_table(table, f, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


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
        self.carry_names = [f.name for f in schema if f.name not in RESERVED_COLUMNS]
        self._expected: deque[int] = deque()
        self._held: list[tuple[int, int, ResultRow]] = []  # heap of (seq, n_index, row)
        self._next_part = run_dir.next_part_number()
        self.parts_written: list[str] = []

    def expect(self, seq: int) -> None:
        if self.in_input_order:
            self._expected.append(seq)

    def add(self, rows: Iterable[ResultRow]) -> None:
        """Add all the result rows of one input row (its n completions) together, so a
        row is always committed whole."""
        if not self.in_input_order:
            self.buffer.extend(rows)
        else:
            for r in rows:
                heapq.heappush(self._held, (r.seq, r.n_index, r))
            self._release_in_order()
        # The buffer only ever holds whole input rows, so a part never splits the n
        # completions of one row.
        if len(self.buffer) >= self.rows_per_part:
            self._write_part(self.buffer)
            self.buffer = []

    def _release_in_order(self) -> None:
        while self._expected and self._held and self._held[0][0] == self._expected[0]:
            seq = self._expected.popleft()
            while self._held and self._held[0][0] == seq:
                self.buffer.append(heapq.heappop(self._held)[2])

    def flush(self) -> None:
        """Write what is buffered as a (possibly short) part."""
        if self.in_input_order:
            # At the end (or on interrupt) rows still held are written in order anyway;
            # their missing predecessors were never sent and will be redone on resume.
            while self._held:
                self.buffer.append(heapq.heappop(self._held)[2])
            self._expected.clear()
        if self.buffer:
            self._write_part(self.buffer)
            self.buffer = []

    def _table(self, rows: list[ResultRow]) -> pa.Table:
        columns = {
            "id": [r.id for r in rows],
            "n_index": [r.n_index for r in rows],
            "status": [r.status for r in rows],
            "text": [r.text for r in rows],
            "finish_reason": [r.finish_reason for r in rows],
            "prompt_tokens": [r.prompt_tokens for r in rows],
            "completion_tokens": [r.completion_tokens for r in rows],
            "cluster_id": [r.cluster_id for r in rows],
            "error": [r.error for r in rows],
            "error_type": [r.error_type for r in rows],
            "seed": [r.seed for r in rows],
            "model": [self.model] * len(rows),
            "job_fingerprint": [self.fingerprint] * len(rows),
        }
        for name in self.carry_names:
            columns[name] = [r.carry.get(name) for r in rows]
        return pa.Table.from_pydict(columns, schema=self.schema)

    def _write_part(self, rows: list[ResultRow]) -> None:
        name = f"part-{self._next_part:05d}.parquet"
        self._next_part += 1
        table = self._table(rows)
        write_part_file(table, self.run_dir.results / name)
        errors = [r for r in rows if not r.ok]
        if errors:
            write_part_file(self._table(errors), self.run_dir.errors / name)
        entry = ManifestEntry(
            part=name,
            rows=len(rows),
            ok=len(rows) - len(errors),
            error=len(errors),
            prompt_tokens=sum(r.prompt_tokens for r in rows if r.n_index == 0),
            completion_tokens=sum(r.completion_tokens for r in rows),
            time=time.time(),
            session=self.session,
        )
        self.run_dir.append_manifest(entry)
        self.parts_written.append(name)
        if self.on_commit is not None:
            self.on_commit(entry)
