"""A run directory on object storage: `output.path` given as a URI (`s3://bucket/run`,
`gs://bucket/run`, or any other URI `pyarrow.fs.FileSystem.from_uri` resolves, such as
`file:///shared/run`).

`StorePath` does, through pyarrow.fs, the pathlib operations the run directory code uses
(`/`, exists, glob, read/write, replace, unlink, ...), so the same code commits, checks and
resumes a run whether its directory is a path or a URI. It has no `__fspath__` on
purpose: `open()`, `os.replace` or `os.fsync` on one fails at once instead of writing a
local file named like the object.

What durability means there. Object stores have no fsync and no directories: an object
is durable once the request that wrote it returned (S3 and GCS acknowledge a PUT only
after storing it redundantly), and a whole object appears at once, never half written.
So a write goes to a hidden tmp name, is closed (uploaded), then moved to its name, as on
a filesystem; the move is a copy and a delete there, so a reader may see both names for
a moment, never a partial part. An append rewrites the object whole: right for the files
one process appends to (the driver's manifest and quarantine notes); engine_faults.jsonl,
which every worker appends to, may lose an event when two append at the same moment (a
diagnostic record: no result depends on it). There is no lock (batchgen.run_lock): one
driver per run directory is the user's to ensure.

`read_table`, `read_schema`, `read_metadata` and `parquet_file` are pyarrow.parquet's,
for a Path or a StorePath alike.
"""

from __future__ import annotations

import fnmatch
import io
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchgen.job_spec import JobError

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(path: str | Path | StorePath) -> bool:
    """Whether `path` names object storage (a URI, or a StorePath made from one)."""
    return isinstance(path, StorePath) or (isinstance(path, str) and bool(_URI.match(path)))


def run_path(path: str | Path) -> Path | StorePath:
    """The run directory's root: a StorePath for a URI, else a Path."""
    if isinstance(path, StorePath):
        return path
    return StorePath.from_uri(path) if is_uri(path) else Path(path)


class _Upload(io.BytesIO):
    """A file opened for writing on the store: its bytes are uploaded when it is closed
    (`append`: after the object's current bytes). A `with` block that raises uploads
    nothing, so an object is written whole or not at all."""

    def __init__(self, target: StorePath, append: bool) -> None:
        super().__init__()
        self.target = target
        self.aborted = False
        if append and target.exists():
            self.write(target.read_bytes())

    def __exit__(self, kind, *rest):
        self.aborted = self.aborted or kind is not None
        return super().__exit__(kind, *rest)

    def close(self) -> None:
        if not self.closed and not self.aborted:
            data = self.getvalue()
            with self.target.fs.open_output_stream(self.target.key) as out:
                out.write(data)
        super().close()


class _TextUpload(io.TextIOWrapper):
    def __exit__(self, kind, *rest):
        self.buffer.aborted = self.buffer.aborted or kind is not None
        return super().__exit__(kind, *rest)


# What StorePath.open returns: none has an OS file descriptor to fsync.
StoreFiles = (_Upload, _TextUpload, io.StringIO, pa.NativeFile)


class StorePath:
    def __init__(self, fs: pafs.FileSystem, key: str, scheme: str) -> None:
        self.fs = fs
        self.key = posixpath.normpath(key) if key else key
        self.scheme = scheme  # "s3://", printed before the key

    @classmethod
    def from_uri(cls, uri: str) -> StorePath:
        try:
            fs, key = pafs.FileSystem.from_uri(uri)
        except (OSError, ValueError, TypeError) as exc:
            # A run directory's root is always the job's output.path.
            message = " ".join(str(exc).split())[:300]
            raise JobError(f"output.path: cannot open {uri}: {message}") from None
        scheme = uri[: uri.index("://") + 3]
        return cls(fs, key.rstrip("/"), scheme)

    # -- names ----------------------------------------------------------------------

    def _pure(self) -> PurePosixPath:
        return PurePosixPath(self.key)

    def _with(self, key: str) -> StorePath:
        return StorePath(self.fs, key, self.scheme)

    def __truediv__(self, other: str) -> StorePath:
        return self._with(posixpath.join(self.key, str(other)))

    def __str__(self) -> str:
        return self.scheme + (self.key if self.scheme == "file://" else self.key.lstrip("/"))

    def __repr__(self) -> str:
        return f"StorePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and (self.scheme, self.key) == (
            other.scheme,
            other.key,
        )

    def __hash__(self) -> int:
        return hash((self.scheme, self.key))

    def __lt__(self, other: StorePath) -> bool:
        return self.key < other.key

    @property
    def name(self) -> str:
        return self._pure().name

    @property
    def suffix(self) -> str:
        return self._pure().suffix

    @property
    def stem(self) -> str:
        return self._pure().stem

    @property
    def parent(self) -> StorePath:
        return self._with(str(self._pure().parent))

    def with_name(self, name: str) -> StorePath:
        return self._with(str(self._pure().with_name(name)))

    def with_suffix(self, suffix: str) -> StorePath:
        return self._with(str(self._pure().with_suffix(suffix)))

    def relative_to(self, other: StorePath) -> PurePosixPath:
        return self._pure().relative_to(other._pure())

    def resolve(self) -> StorePath:
        return self

    # -- what is there ----------------------------------------------------------------

    def _info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.key)

    def exists(self) -> bool:
        return self._info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self._info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return self._info().type == pafs.FileType.Directory

    def stat(self) -> SimpleNamespace:
        info = self._info()
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(str(self))
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        return SimpleNamespace(st_size=info.size, st_mtime=mtime)

    def _listing(self, recursive: bool) -> list[StorePath]:
        if not self.is_dir():
            return []
        selector = pafs.FileSelector(self.key, recursive=recursive, allow_not_found=True)
        return sorted(self._with(info.path) for info in self.fs.get_file_info(selector))

    def iterdir(self) -> Iterator[StorePath]:
        yield from self._listing(recursive=False)

    def glob(self, pattern: str) -> Iterator[StorePath]:
        if "/" in pattern:
            raise ValueError(f"StorePath.glob takes a name pattern, not {pattern!r}")
        yield from (p for p in self._listing(False) if fnmatch.fnmatchcase(p.name, pattern))

    def rglob(self, pattern: str) -> Iterator[StorePath]:
        yield from (p for p in self._listing(True) if fnmatch.fnmatchcase(p.name, pattern))

    # -- reading and writing ------------------------------------------------------------

    def open(self, mode: str = "r", encoding: str | None = None):
        if mode == "rb":
            return self.fs.open_input_file(self.key)
        if mode == "r":
            return io.StringIO(self.read_text(encoding=encoding))
        if mode in ("wb", "ab"):
            return _Upload(self, append=mode == "ab")
        if mode in ("w", "a"):
            return _TextUpload(_Upload(self, append=mode == "a"), encoding=encoding or "utf-8")
        raise ValueError(f"StorePath.open: mode {mode!r} is not supported")

    def read_bytes(self) -> bytes:
        try:
            with self.fs.open_input_stream(self.key) as f:
                return f.read()
        except FileNotFoundError:
            raise FileNotFoundError(str(self)) from None

    def read_text(self, encoding: str | None = None, errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding or "utf-8", errors)

    def write_bytes(self, data: bytes) -> None:
        with self.fs.open_output_stream(self.key) as out:
            out.write(data)

    def write_text(self, text: str, encoding: str | None = None) -> None:
        self.write_bytes(text.encode(encoding or "utf-8"))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        if self.exists() and not exist_ok:
            raise FileExistsError(str(self))
        self.fs.create_dir(self.key, recursive=parents)

    def replace(self, target: StorePath) -> StorePath:
        self.fs.move(self.key, target.key)
        return target

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self.fs.delete_file(self.key)

    def rmdir(self) -> None:
        self.fs.delete_dir(self.key)

    def copy_to(self, target: StorePath) -> None:
        self.fs.copy_file(self.key, target.key)

    def download(self, local: Path) -> None:
        """Stream this object into the local file `local`."""
        pafs.copy_files(self.key, str(local), source_filesystem=self.fs)

    def upload(self, local: Path) -> None:
        """Stream the local file `local` into this object."""
        pafs.copy_files(str(local), self.key, destination_filesystem=self.fs)


def _source(path: Path | StorePath) -> dict:
    if isinstance(path, StorePath):
        return {"source": path.key, "filesystem": path.fs}
    return {"source": path, "filesystem": None}


def read_table(path: Path | StorePath, **kwargs):
    s = _source(path)
    return pq.read_table(s["source"], filesystem=s["filesystem"], **kwargs)


def read_schema(path: Path | StorePath):
    s = _source(path)
    return pq.read_schema(s["source"], filesystem=s["filesystem"])


def read_metadata(path: Path | StorePath):
    s = _source(path)
    return pq.read_metadata(s["source"], filesystem=s["filesystem"])


def parquet_file(path: Path | StorePath) -> pq.ParquetFile:
    s = _source(path)
    return pq.ParquetFile(s["source"], filesystem=s["filesystem"])
