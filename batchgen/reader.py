"""Parquet input, read batch by batch (never a whole file), and the checks that must pass
before a job runs: files exist, the columns are there with one type in every file, their
text is valid UTF-8, ids are present and unique."""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.job_spec import InputSpec, JobError
from batchgen.rows import InputRow

CONTENT_HASH = "content_hash"
MAX_NAMED_DUPLICATES = 5


def resolve_input_files(path: str) -> list[Path]:
    """A file, a directory (its *.parquet files, sorted) or a glob, as a sorted file list."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.parquet") if f.is_file())
        if not files:
            raise JobError(f"input.path: directory {path} holds no .parquet files")
        return files
    if any(ch in path for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
        if not files:
            raise JobError(f"input.path: glob {path} matches no files")
        return files
    raise JobError(f"input.path: input file not found: {path}")


def input_schema(files: list[Path]) -> pa.Schema:
    """The schema of the first file; every other file must have the same column names."""
    try:
        schema = pq.read_schema(files[0])
    except (OSError, pa.ArrowInvalid) as exc:
        raise JobError(f"input.path: {files[0]} is not a readable Parquet file: {exc}") from None
    for f in files[1:]:
        try:
            other = pq.read_schema(f)
        except (OSError, pa.ArrowInvalid) as exc:
            raise JobError(f"input.path: {f} is not a readable Parquet file: {exc}") from None
        if set(other.names) != set(schema.names):
            raise JobError(
                f"input.path: {f} has columns {other.names}, but {files[0]} has {schema.names}"
            )
    return schema


def _holds_text(kind: pa.DataType) -> bool:
    """Whether values of this type hold strings (at any depth: lists, structs, maps)."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return True
    if pa.types.is_dictionary(kind):
        return _holds_text(kind.value_type)
    return any(_holds_text(kind.field(i).type) for i in range(kind.num_fields))


def _first_invalid(column: pa.Array) -> int | None:
    """The index of the first value whose text is not valid UTF-8, or None. Arrow's full
    validation checks every string; a failure is narrowed down by halving."""
    try:
        column.validate(full=True)
        return None
    except pa.ArrowInvalid:
        pass
    lo, hi = 0, len(column)  # the first bad value is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            column.slice(lo, mid - lo).validate(full=True)
            lo = mid
        except pa.ArrowInvalid:
            hi = mid
    return lo


def content_id(values: dict) -> str:
    """A stable id from a row's values: the same content gives the same id on every run."""
    blob = json.dumps(values, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.blake2b(blob.encode("utf-8"), digest_size=10).hexdigest()


def _row_ids(batch: pa.RecordBatch, id_source: str, columns: list[str]) -> list[str]:
    if id_source == CONTENT_HASH:
        rows = batch.select(columns).to_pylist()
        return [content_id(r) for r in rows]
    return [None if v is None else str(v) for v in batch.column(id_source).to_pylist()]


class ParquetInput:
    """The job's input: which files, which columns, and how ids are made."""

    def __init__(self, spec: InputSpec):
        self.spec = spec
        self.files = resolve_input_files(spec.path)
        self.schema = input_schema(self.files)
        self.id_source = spec.id_source
        names = self.schema.names
        if self.id_source != CONTENT_HASH and self.id_source not in names:
            raise JobError(
                f"input.id_column: column '{self.id_source}' not found in {self.files[0]} "
                f"(columns: {names})"
            )
        wanted = list(spec.columns) if spec.columns is not None else list(names)
        for col in wanted:
            if col not in names:
                raise JobError(
                    f"input.columns: column '{col}' not found in {self.files[0]} ({names})"
                )
        self.columns = wanted
        self.read_columns: list[str] = []
        self.add_columns([])

    def add_columns(self, columns: list[str]) -> None:
        """Also read these columns (the template's, the carried ones) even when
        input.columns leaves them out. The caller checked that they exist."""
        self.columns = list(dict.fromkeys([*self.columns, *columns]))
        extra_id = [] if self.id_source == CONTENT_HASH else [self.id_source]
        self.read_columns = list(dict.fromkeys([*self.columns, *extra_id]))

    @property
    def id_type(self) -> pa.DataType:
        """The type of the results' id column: an integer or string id column keeps its
        type; content_hash ids, and ids of any other type, are written as their text."""
        if self.id_source == CONTENT_HASH:
            return pa.string()
        kind = self.schema.field(self.id_source).type
        if pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind):
            return kind
        return pa.string()

    def value_columns(self) -> list[str]:
        """The columns a row carries (everything read except the id column)."""
        return [c for c in self.columns if c != self.id_source]

    def _batches(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        for _, _, batch in self._located_batches(columns):
            yield batch

    def _located_batches(self, columns: list[str]) -> Iterator[tuple[Path, int, pa.RecordBatch]]:
        """(file, index of the batch's first row in that file, batch)."""
        for f in self.files:
            pf = pq.ParquetFile(f)
            first = 0
            for batch in pf.iter_batches(batch_size=self.spec.batch_rows, columns=columns):
                yield f, first, batch
                first += batch.num_rows

    def check_types(self) -> None:
        """Refuse files that give a column read by the job another type than the first
        file does: results are written with one schema, and a column that is text in one
        file and numbers in another cannot go into it."""
        for f in self.files[1:]:
            other = pq.read_schema(f)
            for name in self.read_columns:
                want, got = self.schema.field(name).type, other.field(name).type
                if got != want:
                    raise JobError(
                        f"input.path: column '{name}' is {got} in {f} but {want} in "
                        f"{self.files[0]}; every input file must give a column one type"
                    )

    def check_text(self) -> None:
        """Refuse invalid UTF-8 in any text column the job reads, naming the file, column
        and first bad row: one pass over those columns before any work, since a bad value
        found mid-run would stop the run there, and again on every resume."""
        text_columns = [c for c in self.read_columns if _holds_text(self.schema.field(c).type)]
        if not text_columns:
            return
        for f, first, batch in self._located_batches(text_columns):
            self._refuse_invalid_text(f, first, batch)

    def _refuse_invalid_text(self, f: Path, first: int, batch: pa.RecordBatch) -> None:
        for name in batch.schema.names:
            bad = _first_invalid(batch.column(name))
            if bad is None:
                continue
            where = f"row {first + bad} of {f}"
            if self.id_source not in (CONTENT_HASH, name) and self.id_source in batch.schema.names:
                where += f" (id {batch.column(self.id_source)[bad].as_py()!r})"
            raise JobError(
                f"input: column '{name}' holds invalid UTF-8 at {where}; every text "
                "value must be valid UTF-8"
            )

    def count_rows(self) -> int:
        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)

    def rows(self) -> Iterator[InputRow]:
        """Every input row in file order, one record batch in memory at a time."""
        seq = 0
        for f, first, batch in self._located_batches(self.read_columns):
            yield from self._batch_rows(f, first, batch, range(seq, seq + batch.num_rows))
            seq += batch.num_rows

    def read_slice(self, file: int, row_group: int, offset: int, count: int) -> pa.Table:
        """`count` rows of one row group of `self.files[file]` from `offset` on, the
        columns the job reads: one block of a distributed run, read alone."""
        pf = pq.ParquetFile(self.files[file])
        return pf.read_row_group(row_group, columns=self.read_columns).slice(offset, count)

    def table_rows(
        self, file: int, first: int, table: pa.Table, seqs: list[int]
    ) -> Iterator[InputRow]:
        """The rows of `table` (columns as `read_slice` gives them, some rows maybe left
        out) whose input positions are `seqs`; `first` is the file row of the first, for
        error messages."""
        done = 0
        for batch in table.to_batches(max_chunksize=self.spec.batch_rows):
            rows = seqs[done : done + batch.num_rows]
            yield from self._batch_rows(self.files[file], first + done, batch, rows)
            done += batch.num_rows

    def _batch_rows(
        self, f: Path, first: int, batch: pa.RecordBatch, seqs: Iterable[int]
    ) -> Iterator[InputRow]:
        try:
            ids = _row_ids(batch, self.id_source, self.columns)
            values = batch.select(self.value_columns()).to_pylist()
        except UnicodeDecodeError:  # check_text finds these first, when it ran
            self._refuse_invalid_text(f, first, batch)
            raise
        for seq, row_id, vals in zip(seqs, ids, values):
            yield InputRow(seq=seq, id=row_id, values=vals)

    def column_values(self, name: str) -> Iterator:
        """The values of one column the job reads, in input order, reading only it."""
        for batch in self._batches([name]):
            yield from batch.column(name).to_pylist()

    def ids(self) -> Iterator[str | None]:
        """Only the ids, reading as few columns as possible."""
        cols = self.columns if self.id_source == CONTENT_HASH else [self.id_source]
        for batch in self._batches(cols):
            yield from _row_ids(batch, self.id_source, self.columns)

    def table_ids(self, table: pa.Table) -> list[str | None]:
        """The ids of the rows of `table` (columns as `read_slice` gives them)."""
        return [
            i for batch in table.to_batches() for i in _row_ids(batch, self.id_source, self.columns)
        ]

    def row_group_ids(self, file: int, row_group: int) -> list[str | None]:
        """The ids of one row group of `self.files[file]`, in order."""
        cols = self.columns if self.id_source == CONTENT_HASH else [self.id_source]
        table = pq.ParquetFile(self.files[file]).read_row_group(row_group, columns=cols)
        return _row_ids(table, self.id_source, self.columns)

    def check_ids(self) -> int:
        """Refuse null or duplicate ids, naming the first few; return the row count.

        Memory stays at 8 bytes per row: a 64-bit hash of every id goes into one numpy
        array; only ids whose hash repeats are looked at again, by a second pass."""
        hashes: list[np.ndarray] = []
        chunk: list[int] = []
        count = 0
        for seq, row_id in enumerate(self.ids()):
            if row_id is None or row_id == "":
                raise JobError(
                    f"input: row {seq} has an empty id in column '{self.id_source}' "
                    f"({self.files[0] if len(self.files) == 1 else self.spec.path})"
                )
            chunk.append(hash(row_id))
            count += 1
            if len(chunk) >= 65536:
                hashes.append(np.array(chunk, dtype=np.int64))
                chunk = []
        hashes.append(np.array(chunk, dtype=np.int64))
        all_hashes = np.sort(np.concatenate(hashes))
        del hashes
        repeated = all_hashes[1:][all_hashes[1:] == all_hashes[:-1]]
        if repeated.size == 0:
            return count
        suspects = set(repeated.tolist())
        seen: set[str] = set()
        duplicates: list[str] = []
        for row_id in self.ids():
            if hash(row_id) not in suspects:
                continue
            if row_id in seen and row_id not in duplicates:
                duplicates.append(row_id)
            seen.add(row_id)
        if not duplicates:  # 64-bit hash collision between distinct ids
            return count
        named = ", ".join(repr(d) for d in duplicates[:MAX_NAMED_DUPLICATES])
        more = f" and {len(duplicates) - MAX_NAMED_DUPLICATES} more" if len(duplicates) > 5 else ""
        what = "identical rows (id: content_hash)" if self.id_source == CONTENT_HASH else "ids"
        raise JobError(
            f"input: duplicate {what} in column '{self.id_source}': {named}{more}; "
            "every row needs a unique id"
        )
