"""A run directory on object storage, exercised on pyarrow's in-memory mock filesystem
(no local file can stand in for an object there): parts committed tmp -> move with their
manifest lines, the run directory check adopting an unrecorded part, removing a
half-written one and setting a damaged one aside, and the committed ids a resume skips."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner

from batchgen.cli.run import run_cmd
from batchgen.job_spec import JobError, parse_job
from batchgen.resume import committed_ids
from batchgen.run_dir import RunDir
from batchgen.run_dir_check import reconcile
from batchgen.store_path import StorePath, is_uri, read_table, run_path
from batchgen.writer import commit_part, write_part
from tests.batchgen.conftest import write_job

FINGERPRINT = "f" * 16


def _part(ids: list[int], errors: int = 0) -> pa.Table:
    n = len(ids)
    status = ["error"] * errors + ["ok"] * (n - errors)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "n_index": [0] * n,
            "status": status,
            "text": [None if s == "error" else f"t{i}" for s, i in zip(status, ids)],
            "finish_reason": [None if s == "error" else "stop" for s in status],
            "prompt_tokens": [3] * n,
            "completion_tokens": [0 if s == "error" else 2 for s in status],
            "cluster_id": pa.array([None] * n, pa.int32()),
            "error": ["bad" if s == "error" else None for s in status],
        }
    )


@pytest.fixture
def store_run() -> RunDir:
    root = StorePath(pafs._MockFileSystem(), "bucket/run", "mock://")
    run_dir = RunDir(root)
    run_dir.create()
    (root / "job.json").write_text(json.dumps({"fingerprint": FINGERPRINT}))
    return run_dir


def test_store_paths_parse_and_refuse_the_os():
    assert is_uri("s3://bucket/run") and is_uri("file:///tmp/run") and not is_uri("runs/x")
    path = run_path("file:///tmp/some/run")
    assert isinstance(path, StorePath) and str(path / "results") == "file:///tmp/some/run/results"
    assert path.parent.name == "some" and (path / "a.parquet").with_suffix(".tmp").name == "a.tmp"
    with pytest.raises(TypeError):
        open(path / "x")  # noqa: SIM115 - no __fspath__: never a local file by mistake
    with pytest.raises(JobError, match="output.path: cannot open nosuch://"):
        run_path("nosuch://bucket/run")


def test_parts_commit_through_the_store_and_a_resume_counts_them(store_run):
    commit_part(store_run, _part([1, 2, 3]), "part-00001.parquet", FINGERPRINT, "s1")
    commit_part(store_run, _part([4, 5], errors=1), "part-00002.parquet", FINGERPRINT, "s1")
    lines = store_run.entries()
    assert [e.part for e in lines] == ["part-00001.parquet", "part-00002.parquet"]
    assert lines[1].error == 1 and (store_run.errors / "part-00002.parquet").is_file()
    assert not list(store_run.results.glob(".*.tmp"))  # every write reached its name
    assert read_table(store_run.results / "part-00001.parquet").column("id").to_pylist() == [
        1,
        2,
        3,
    ]
    ids, ok, error = committed_ids(store_run)
    assert ids == {"1", "2", "3", "4", "5"} and (ok, error) == (4, 1)
    assert store_run.next_part_number() == 3


def test_the_run_directory_check_works_on_the_store(store_run):
    commit_part(store_run, _part([1, 2]), "part-00001.parquet", FINGERPRINT, "s1")
    commit_part(store_run, _part([3, 4]), "part-00002.parquet", FINGERPRINT, "s1")
    # A part written whose line was never appended (the driver died in between)...
    write_part(
        _part([5, 6]), "part-00003.parquet", FINGERPRINT, "s1", store_run.results, store_run.errors
    )
    # ...a write that never reached its move...
    (store_run.results / ".part-00004.parquet.tmp").write_bytes(b"PAR1 torn")
    # ...and a committed part whose object changed since.
    (store_run.results / "part-00002.parquet").write_bytes(b"not the committed bytes")

    found = reconcile(store_run, FINGERPRINT, "s2")
    assert [e.part for e in found.adopted] == ["part-00003.parquet"]
    assert [e.part for e, _ in found.damaged] == ["part-00002.parquet"]
    assert not (store_run.results / ".part-00004.parquet.tmp").exists()
    assert not (store_run.results / "part-00002.parquet").exists()
    assert (store_run.quarantine_dir / "s2" / "results" / "part-00002.parquet").is_file()
    notes = (store_run.quarantine_dir / "s2" / "reasons.jsonl").read_text().splitlines()
    assert any("part-00002.parquet" in json.loads(n)["file"] for n in notes)
    # The manifest now names what counts; the damaged part's ids run again.
    assert [e.part for e in store_run.live_parts()] == ["part-00001.parquet", "part-00003.parquet"]
    assert committed_ids(store_run)[0] == {"1", "2", "5", "6"}
    # Names in use, the quarantined one included, are never given again (the removed tmp
    # file held no committed name).
    assert store_run.next_part_number() == 4


def _store_job(tmp_path, **sections):
    job = {
        "input": {"path": str(tmp_path / "in.parquet")},
        "prompt": {"template": "{{ text }}"},
        "output": {"path": f"file://{tmp_path}/run"},
        "executor": {"type": "ray"},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return parse_job(job)


@pytest.mark.parametrize(
    "sections, new_run, message",
    [
        ({"output": {"export": "openai_batch"}}, False, "output.export is not supported"),
        ({}, True, "--new-run is not supported"),
    ],
)
def test_what_a_run_on_object_storage_cannot_hold_is_refused(tmp_path, sections, new_run, message):
    from batchgen.executors.ray_executor import check_object_storage_job

    job = _store_job(tmp_path, **sections)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "job.json").write_text("{}")  # a run is there
    with pytest.raises(JobError, match=message):
        check_object_storage_job(job, new_run)


def test_the_local_executor_refuses_object_storage_with_exit_2(tmp_path):
    job = {
        "input": {"path": str(tmp_path / "in.parquet")},
        "prompt": {"template": "{{ text }}"},
        "output": {"path": f"file://{tmp_path}/run"},
    }
    result = CliRunner().invoke(run_cmd, [str(write_job(tmp_path / "job.yaml", job))])
    assert result.exit_code == 2
    assert "the local executor does not write to" in result.output
    assert "executor: {type: ray}" in result.output
    assert not (tmp_path / "run").exists()


def test_a_write_that_fails_leaves_no_object(store_run):
    target = store_run.path / "notes.txt"
    for mode, data in (("w", "half"), ("wb", b"half")):
        with pytest.raises(RuntimeError), target.open(mode) as f:
            f.write(data)
            raise RuntimeError("the writer failed mid-way")
        assert not target.exists()
    with target.open("a") as f:
        f.write("one\n")
    with pytest.raises(RuntimeError), target.open("a") as f:
        f.write("two\n")
        raise RuntimeError("the writer failed mid-way")
    assert target.read_text() == "one\n"
