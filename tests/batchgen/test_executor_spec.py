"""The job file's executor section and `batchgen run --executor`: local by default, Ray
keys only with type ray, the executor outside the fingerprint (a run may be resumed on
either), and `executor: ray` without Ray installed refused with exit 2 and the install
command."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from batchgen.cli.run import run_cmd
from batchgen.job_spec import JobError, parse_job
from tests.batchgen.conftest import write_job

BASE = {
    "input": {"path": "in.parquet"},
    "prompt": {"template": "{{ text }}"},
    "output": {"path": "run"},
}


def test_default_is_local_and_the_executor_is_not_fingerprinted():
    local = parse_job(BASE)
    assert local.executor.type == "local"
    on_ray = parse_job(
        {
            **BASE,
            "executor": {
                "type": "ray",
                "address": "ray://head:10001",
                "num_workers": 4,
                "resources_per_worker": {"GPU": 1},
            },
        }
    )
    assert on_ray.executor.num_workers == 4
    assert on_ray.executor.resources_per_worker == {"GPU": 1.0}
    assert on_ray.fingerprint == local.fingerprint


@pytest.mark.parametrize(
    "executor, named",
    [
        ({"num_workers": 2}, "need type: ray"),
        ({"type": "ray", "resources_per_worker": {"GPU": 0}}, "resources_per_worker.GPU"),
        ({"type": "ray", "num_workers": 0}, "executor.num_workers"),
        ({"type": "spark"}, "executor.type"),
        ({"type": "ray", "workers": 2}, "executor.workers"),
    ],
)
def test_bad_executor_sections_are_refused_by_name(executor, named):
    with pytest.raises(JobError, match=named.replace(".", r"\.")):
        parse_job({**BASE, "executor": executor})


def _job_file(tmp_path, executor=None):
    job = {**BASE, "input": {"path": str(tmp_path / "in.parquet")}}
    job["output"] = {"path": str(tmp_path / "run")}
    if executor:
        job["executor"] = executor
    return write_job(tmp_path / "job.yaml", job)


def test_ray_without_ray_installed_exits_2_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    job = _job_file(tmp_path, {"type": "ray"})
    result = CliRunner().invoke(run_cmd, [str(job)])
    assert result.exit_code == 2
    assert "pip install -e '.[ray]'" in result.output
    assert not (tmp_path / "run").exists()  # nothing was run or written


def test_executor_flag_overrides_the_job_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    job = _job_file(tmp_path)
    result = CliRunner().invoke(run_cmd, [str(job), "--executor", "ray"])
    assert result.exit_code == 2 and "pip install -e '.[ray]'" in result.output
    result = CliRunner().invoke(run_cmd, [str(job), "--executor", "nope"])
    assert result.exit_code == 2 and "nope" in result.output
