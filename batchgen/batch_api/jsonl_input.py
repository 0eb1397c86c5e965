"""A batch request file (OpenAI Batch or Anthropic Message Batches JSONL) as the job's
input: one request per line, read line by line (never the whole file), each line's
custom_id its row id.

The file is checked whole before any work, as the services check an upload: a line that
is not a JSON object, has no custom_id, or repeats another line's custom_id refuses the
job, naming every such line (up to MAX_NAMED_LINES per kind). What a request asks for is
checked per row when it is prepared (a wrong value makes that row an error row)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa

from batchgen.batch_api import anthropic_request, openai_request
from batchgen.job_spec import InputSpec, JobError, cut
from batchgen.rows import InputRow

# A request line is a few KB; OpenAI caps a whole batch file at 200 MB.
MAX_LINE_BYTES = 64 << 20
MAX_NAMED_LINES = 20
ID_SOURCE = "custom_id"
REQUEST = "request"  # InputRow.values key holding the parsed line
# The columns a request carries into its results.
CARRY_COLUMNS = ("request_model", "endpoint")


def detect_format(spec: InputSpec) -> str:
    """input.format, or by extension (.parquet; .jsonl/.json), then by content: a Parquet
    file starts with PAR1; a request file's first line has `params` (Anthropic) or
    `body`/`url` (OpenAI)."""
    if spec.format is not None:
        return spec.format
    path = Path(spec.path)
    suffix = path.suffix.lower()
    if suffix == ".parquet" or not path.is_file():
        return "parquet"  # a directory or glob of Parquet files, or a missing file
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PAR1":
        return "parquet"
    first = _first_request(path)
    if first is None:
        # No request object near the top: a request file whose check names its bad lines,
        # or (another extension) a file for the Parquet reader to refuse.
        return "openai_batch" if suffix in (".jsonl", ".json") else "parquet"
    if "params" in first:
        return "anthropic_batch"
    if "body" in first or "url" in first:
        return "openai_batch"
    raise JobError(
        f"input.path: cannot tell whether {path} is an OpenAI or Anthropic batch file from "
        "its first request; set input.format: openai_batch or anthropic_batch"
    )


def _first_request(path: Path, lines: int = 100) -> dict | None:
    """The first line among the first `lines` that is a JSON object."""
    with open(path, "rb") as f:
        for raw in islice(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), lines):
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict):
                return line
    return None


class _Problems:
    """Line numbers of one kind of problem: the first MAX_NAMED_LINES and a count."""

    def __init__(self, what: str):
        self.what = what
        self.lines: list[int] = []
        self.count = 0

    def add(self, line: int) -> None:
        self.count += 1
        if len(self.lines) < MAX_NAMED_LINES:
            self.lines.append(line)

    def describe(self) -> str:
        more = f" and {self.count - len(self.lines):,} more" if self.count > len(self.lines) else ""
        return f"{self.what} at line(s) {', '.join(map(str, self.lines))}{more}"


class BatchFileInput:
    """The job's input when it is a request file; the interface of reader.ParquetInput."""

    id_source = ID_SOURCE
    id_type = pa.string()

    def __init__(self, spec: InputSpec, file_format: str):
        for key in ("id_column", "id", "columns"):
            if getattr(spec, key) is not None:
                raise JobError(
                    f"input.{key}: not used with input.format {file_format} (each request's "
                    "custom_id is its row id); remove it"
                )
        self.spec = spec
        self.format = file_format
        self.path = Path(spec.path)
        if not self.path.is_file():
            raise JobError(f"input.path: input file not found: {spec.path}")
        self.files = [self.path]
        self.parse = (
            openai_request.parse_openai_line
            if file_format == "openai_batch"
            else anthropic_request.parse_anthropic_line
        )
        module = openai_request if file_format == "openai_batch" else anthropic_request
        self._model_of = module.request_model
        self._endpoint_of = module.request_endpoint
        self.schema = pa.schema(
            [pa.field(ID_SOURCE, pa.string())] + [pa.field(c, pa.string()) for c in CARRY_COLUMNS]
        )
        self.columns = list(CARRY_COLUMNS)
        self.read_columns = list(CARRY_COLUMNS)

    def add_columns(self, columns: list[str]) -> None:
        """A request file has no other columns (open_job never asks for any)."""

    def value_columns(self) -> list[str]:
        return list(CARRY_COLUMNS)

    def check_types(self) -> None:
        """One file, one schema: nothing to compare."""

    def check_text(self) -> None:
        """UTF-8 is checked line by line with the rest of the file, by check_ids."""

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(1-based line number, raw line) of every non-blank line."""
        with open(self.path, "rb") as f:
            number = 0
            while True:
                raw = f.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    return
                number += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise JobError(
                        f"input.path: {self.path} line {number} is longer than "
                        f"{MAX_LINE_BYTES >> 20} MB; a request line is far shorter"
                    )
                if raw.strip():
                    yield number, raw

    def _requests(self) -> Iterator[tuple[int, object]]:
        """(line number, the parsed line, or None when it is not JSON)."""
        for number, raw in self._lines():
            try:
                yield number, json.loads(raw)
            except ValueError:  # UnicodeDecodeError included
                yield number, None

    def count_rows(self) -> int:
        return sum(1 for _ in self._lines())

    def rows(self) -> Iterator[InputRow]:
        """Every request in file order (check_ids has refused a file with bad lines)."""
        for seq, (number, line) in enumerate(self._requests()):
            if not isinstance(line, dict) or not _custom_id(line):
                raise JobError(f"input.path: {self.path} line {number} changed during the run")
            values = {
                REQUEST: line,
                "request_model": self._model_of(line),
                "endpoint": self._endpoint_of(line),
            }
            yield InputRow(seq=seq, id=line[ID_SOURCE], values=values)

    def ids(self) -> Iterator[str | None]:
        for _, line in self._requests():
            yield _custom_id(line) if isinstance(line, dict) else None

    def check_ids(self) -> int:
        """Refuse the file if any line is not a JSON object, has no custom_id, or repeats a
        custom_id, naming the lines; return the number of requests.

        Memory stays at 8 bytes per line: a hash of every custom_id goes into a numpy
        array, and only ids whose hash repeats are looked at again, by a second pass."""
        not_json = _Problems("not a JSON object")
        no_id = _Problems("no custom_id (a non-empty string)")
        hashes: list[np.ndarray] = []
        chunk: list[int] = []
        count = 0
        for number, line in self._requests():
            count += 1
            if not isinstance(line, dict):
                not_json.add(number)
                continue
            custom_id = _custom_id(line)
            if custom_id is None:
                no_id.add(number)
                continue
            chunk.append(hash(custom_id))
            if len(chunk) >= 65536:
                hashes.append(np.array(chunk, dtype=np.int64))
                chunk = []
        hashes.append(np.array(chunk, dtype=np.int64))
        problems = [p.describe() for p in (not_json, no_id) if p.count]
        duplicates = self._duplicates(np.sort(np.concatenate(hashes)))
        if duplicates:
            problems.append(duplicates)
        if problems:
            raise JobError(
                f"input.path: {self.path} ({self.format}) is refused, nothing was run: "
                + "; ".join(problems)
            )
        if count == 0:
            raise JobError(f"input.path: {self.path} holds no requests; there is nothing to run")
        return count

    def _duplicates(self, hashes: np.ndarray) -> str | None:
        repeated = hashes[1:][hashes[1:] == hashes[:-1]]
        if repeated.size == 0:
            return None
        suspects = set(repeated.tolist())
        lines_of: dict[str, list[int]] = {}
        for number, line in self._requests():
            custom_id = _custom_id(line) if isinstance(line, dict) else None
            if custom_id is None or hash(custom_id) not in suspects:
                continue
            lines_of.setdefault(custom_id, []).append(number)
        repeats = [(i, lines) for i, lines in lines_of.items() if len(lines) > 1]
        if not repeats:  # 64-bit hash collisions between distinct ids
            return None
        named = []
        for custom_id, lines in repeats[:MAX_NAMED_LINES]:
            shown = ", ".join(map(str, lines[:MAX_NAMED_LINES]))
            if len(lines) > MAX_NAMED_LINES:
                shown += f" and {len(lines) - MAX_NAMED_LINES:,} more"
            named.append(f"{cut(custom_id, 80)!r} at lines {shown}")
        more = len(repeats) - len(named)
        tail = f"; and {more:,} more repeated custom_ids" if more > 0 else ""
        return "duplicate custom_id " + "; ".join(named) + tail


def _custom_id(line: dict) -> str | None:
    value = line.get(ID_SOURCE)
    return value if isinstance(value, str) and value else None
