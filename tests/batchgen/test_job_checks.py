"""Broken jobs are refused before any work: exit 2, the problem named, nothing written."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.job_spec import JobError, load_job, parse_job
from tests.batchgen.conftest import sentence_rows, write_job, write_parquet


def _refused(tmp_path, job_path) -> str:
    result = CliRunner().invoke(main, ["run", str(job_path)])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "run").exists(), "a refused job must write nothing"
    return result.output


@pytest.mark.parametrize(
    "mutate, named",
    [
        (lambda j: j["sampling"].update(temprature=0.5), "unknown key 'sampling.temprature'"),
        (lambda j: j.update(extra_section={}), "unknown key 'extra_section'"),
        (lambda j: j["input"].update(path="nope/missing.parquet"), "nope/missing.parquet"),
        (lambda j: j["input"].update(id_column="row_key"), "'row_key'"),
        (lambda j: j["prompt"].update(template="{{ txet }}"), "['txet']"),
        (lambda j: j["model"].update(path="/no/such/model"), "/no/such/model"),
        (lambda j: j["output"].update(carry_columns=["nope"]), "'nope'"),
        (lambda j: j["batching"].update(cluster="task_kind"), "batching.cluster"),
        (lambda j: j["prompt"].update(template="{{ text "), "prompt.template"),
        (lambda j: j["sampling"].update(max_tokens=0), "sampling.max_tokens"),
        (lambda j: j.pop("output"), "missing key 'output'"),
    ],
)
def test_broken_job_exits_2_naming_the_problem(make_job, tmp_path, mutate, named):
    job, path = make_job()
    mutate(job)
    write_job(path, job)
    assert named in _refused(tmp_path, path)


def test_duplicate_ids_are_named(make_job, tmp_path):
    rows = sentence_rows(30)
    rows[17]["id"] = "r0003"
    rows[25]["id"] = "r0009"
    _, path = make_job(rows=rows)
    output = _refused(tmp_path, path)
    assert "duplicate" in output and "'r0003'" in output and "'r0009'" in output


def test_null_id_is_refused(make_job, tmp_path):
    rows = sentence_rows(5)
    rows[2]["id"] = None
    _, path = make_job(rows=rows)
    assert "row 2 has an empty id" in _refused(tmp_path, path)


def test_content_hash_ids_are_stable(tmp_path):
    from batchgen.reader import ParquetInput

    data = write_parquet(tmp_path / "in.parquet", [{"text": f"row {i}"} for i in range(10)])
    job = parse_job(
        {
            "input": {"path": str(data), "id": "content_hash"},
            "prompt": {"template": "{{ text }}"},
            "output": {"path": str(tmp_path / "run")},
        }
    )
    first = [r.id for r in ParquetInput(job.input).rows()]
    second = [r.id for r in ParquetInput(job.input).rows()]
    assert first == second and len(set(first)) == 10
    assert ParquetInput(job.input).check_ids() == 10


def test_directory_and_glob_inputs(tmp_path):
    from batchgen.reader import ParquetInput

    rows = sentence_rows(30)
    write_parquet(tmp_path / "in" / "a.parquet", rows[:10])
    write_parquet(tmp_path / "in" / "b.parquet", rows[10:])
    for path in (tmp_path / "in", tmp_path / "in" / "*.parquet"):
        job = parse_job(
            {
                "input": {"path": str(path)},
                "prompt": {"template": "{{ text }}"},
                "output": {"path": str(tmp_path / "run")},
            }
        )
        source = ParquetInput(job.input)
        assert [r.id for r in source.rows()] == [r["id"] for r in rows]
        assert source.check_ids() == 30


def test_fingerprint_ignores_fields_that_do_not_change_outputs(make_job, tmp_path):
    job, path = make_job()
    base = load_job(path).fingerprint
    job["output"]["rows_per_part"] = 7
    job["batching"]["max_num_seqs"] = 3
    job["errors"]["budget"] = 0.3
    assert parse_job(job).fingerprint == base
    job["prompt"]["system"] = "Be brief."
    assert parse_job(job).fingerprint != base


def test_load_job_names_the_file_when_missing(tmp_path):
    with pytest.raises(JobError, match="job file not found"):
        load_job(tmp_path / "nope.yaml")
