"""Staged parts of Ray workers: the driver commits a staged part into results/ with its
manifest line only when the file is the one the worker reported; what no driver recorded
is quarantined (never deleted, never counted), unfinished writes removed; a part moved into
results/ whose line was never appended is adopted by the run directory check."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from batchgen.executors.staging import (
    commit_staged,
    set_aside_unrecorded,
    staging_dir,
)
from batchgen.part_check import PartDamaged
from batchgen.resume import committed_ids
from batchgen.rows import ResultRow
from batchgen.run_dir import RunDir
from batchgen.run_dir_check import reconcile
from batchgen.writer import result_schema, results_table, write_part

FINGERPRINT = "f" * 16


def _rows(ids: list[str], errors: set[str] = frozenset()) -> list[ResultRow]:
    rng = random.Random(ids[0])
    return [
        ResultRow(
            id=i,
            n_index=0,
            status="error" if i in errors else "ok",
            text=None if i in errors else f"t{rng.random()}",
            finish_reason=None if i in errors else "stop",
            prompt_tokens=rng.randrange(1, 9),
            completion_tokens=0 if i in errors else rng.randrange(1, 9),
            cluster_id=None,
            error="bad" if i in errors else None,
            error_type="render" if i in errors else None,
            seed=rng.randrange(10**9),
            carry={},
        )
        for i in ids
    ]


def _stage(run_dir: RunDir, worker: str, name: str, ids: list[str], errors=frozenset()):
    table = results_table(_rows(ids, set(errors)), result_schema([]), "m", FINGERPRINT)
    stage = staging_dir(run_dir, worker)
    (stage / "errors").mkdir(parents=True, exist_ok=True)
    return write_part(table, name, FINGERPRINT, "s1", stage, stage / "errors", worker=worker)


@pytest.fixture
def run_dir(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.create()
    return run


def test_commit_moves_the_part_and_its_errors_then_appends_its_line(run_dir):
    entry = _stage(run_dir, "w1", "part-00001.parquet", ["a", "b", "c"], errors={"b"})
    commit_staged(run_dir, "w1", entry)
    assert (run_dir.results / "part-00001.parquet").exists()
    assert (run_dir.errors / "part-00001.parquet").exists()
    assert [e.part for e in run_dir.entries()] == ["part-00001.parquet"]
    assert run_dir.entries()[0].worker == "w1"
    assert committed_ids(run_dir)[0] == {"a", "b", "c"}
    assert not list(staging_dir(run_dir, "w1").rglob("*.parquet"))
    assert reconcile(run_dir, FINGERPRINT, "s2").clean


def test_a_staged_file_that_is_not_the_reported_part_is_refused(run_dir):
    entry = _stage(run_dir, "w1", "part-00001.parquet", ["a", "b"])
    path = staging_dir(run_dir, "w1") / "part-00001.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(PartDamaged):
        commit_staged(run_dir, "w1", entry)
    assert not run_dir.entries() and not list(run_dir.results.iterdir())


def test_unrecorded_parts_go_to_quarantine_and_tmp_files_are_removed(run_dir):
    _stage(run_dir, "w1", "part-00003.parquet", ["a", "b"], errors={"a"})
    _stage(run_dir, "w2", "part-00003.parquet", ["a", "b"])  # a retried block's copy
    tmp = staging_dir(run_dir, "w2") / ".part-00004.parquet.tmp"
    tmp.write_bytes(b"half a part")
    assert set_aside_unrecorded(run_dir, "s9") == 2
    assert not (run_dir.path / "staging").exists()
    kept = sorted(
        p.relative_to(run_dir.path).as_posix() for p in run_dir.quarantine_dir.rglob("*.parquet")
    )
    assert kept == [
        "quarantine/s9/staging/w1/errors/part-00003.parquet",
        "quarantine/s9/staging/w1/part-00003.parquet",
        "quarantine/s9/staging/w2/part-00003.parquet",
    ]
    assert committed_ids(run_dir)[0] == set()
    # A quarantined name is never given to a new part.
    assert run_dir.next_part_number() == 4


def test_a_part_moved_into_results_without_its_line_is_adopted(run_dir):
    entry = _stage(run_dir, "w1", "part-00001.parquet", ["a", "b"])
    # The driver was killed between the rename into results/ and the manifest append.
    (staging_dir(run_dir, "w1") / entry.part).rename(run_dir.results / entry.part)
    found = reconcile(run_dir, FINGERPRINT, "s2")
    assert [e.part for e in found.adopted] == ["part-00001.parquet"]
    assert committed_ids(run_dir)[0] == {"a", "b"}
    assert run_dir.entries()[0].worker == "w1"


def test_result_table_schema_keeps_carried_columns(run_dir):
    schema = result_schema([pa.field("lang", pa.string())])
    rows = _rows(["a"])
    rows[0].carry = {"lang": "fr"}
    assert results_table(rows, schema, "m", FINGERPRINT).column("lang").to_pylist() == ["fr"]
