"""Engine faults survived, with real `batchgen run` processes and BATCHGEN_FAULT_INJECT:
an out-of-memory or a kernel error mid-job rebuilds the engine and gives the texts of a
clean run, a poison row becomes an engine_error row, an engine that never works stops
with exit 5 (resumable), and a rerun of a finished job loads no model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import polars as pl
import pytest

from batchgen import run as run_module
from batchgen.job_spec import load_job
from batchgen.progress import Progress
from batchgen.run import EXIT_OK, EXIT_SOME_ERRORS, run_job
from engine.fault_injection import ENV_VAR
from tests.batchgen.conftest import sentence_rows, write_job, write_parquet

ROWS = 24
IDS = [f"r{i:04d}" for i in range(ROWS)]
_CLI = [sys.executable, "-c", "from batchgen.cli import main; main()"]


def _write_job(tiny_model_dir: Path, where: Path, budget: float = 0.01) -> Path:
    data = write_parquet(where / "in.parquet", sentence_rows(ROWS))
    return write_job(
        where / "job.yaml",
        {
            "input": {"path": str(data)},
            "prompt": {"template": "Translate into French:\n{{ text }}"},
            "model": {"path": str(tiny_model_dir), "kv_cache_memory": 8 << 20},
            # Seeded sampling: a restart must give the same draws, not only the same argmax.
            "sampling": {"temperature": 0.8, "max_tokens": 8, "seed": 11},
            "batching": {"cluster": "off", "max_num_seqs": 4},
            "output": {"path": str(where / "run"), "rows_per_part": 8},
            "errors": {"budget": budget},
        },
    )


def _run(job: Path, fault: str | None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if fault is not None:
        env[ENV_VAR] = fault
    return subprocess.run(
        [*_CLI, "run", str(job)], capture_output=True, text=True, env=env, timeout=timeout
    )


def _results(job: Path) -> pl.DataFrame:
    return pl.read_parquet(job.parent / "run" / "results" / "*.parquet").sort("id")


def _report(job: Path) -> dict:
    return json.loads((job.parent / "run" / "report.json").read_text())


class _Quiet(Progress):
    def __init__(self):
        super().__init__(None, tty=False, interval=3600, stream=open(os.devnull, "w"))  # noqa: SIM115


@pytest.fixture(scope="module")
def clean(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """The texts of a run without faults (in this process: no fault is injected here)."""
    assert not os.environ.get(ENV_VAR)
    job = _write_job(tiny_model_dir, tmp_path_factory.mktemp("clean"))
    outcome = run_job(load_job(job), job, progress=_Quiet())
    assert outcome.exit_code == EXIT_OK, outcome.message
    df = _results(job)
    assert df["id"].to_list() == IDS
    return dict(zip(df["id"], df["text"]))


@pytest.mark.parametrize("fault", ["oom@step=5", "crash@step=3"])
def test_a_fault_mid_job_restarts_the_engine_and_changes_no_text(
    fault, clean, tiny_model_dir, tmp_path
):
    job = _write_job(tiny_model_dir, tmp_path)
    proc = _run(job, fault)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "Traceback" not in log
    assert f"injected fault {fault}" in log
    if fault.startswith("oom"):
        assert "rebuilding it with max_num_seqs 2 (was 4)" in log
    df = _results(job)
    assert df["id"].to_list() == IDS  # every id exactly once
    assert set(df["status"]) == {"ok"}
    assert dict(zip(df["id"], df["text"])) == clean
    report = _report(job)
    assert report["engine_restarts"] == 1
    assert [f["event"] for f in report["engine_faults"]] == ["step_failed"]
    assert "1 engine restarts after 1 faults" in (job.parent / "run" / "report.md").read_text()


def test_a_poison_row_becomes_an_engine_error_row(clean, tiny_model_dir, tmp_path, monkeypatch):
    job = _write_job(tiny_model_dir, tmp_path, budget=0.1)
    proc = _run(job, "crash@row=r0006")
    log = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_SOME_ERRORS, log
    assert "row r0006 failed alone: it becomes an error row" in log
    df = _results(job)
    assert df["id"].to_list() == IDS
    bad = df.filter(pl.col("status") == "error")
    assert bad["id"].to_list() == ["r0006"]
    assert bad["error_type"].to_list() == ["engine_error"]
    assert "crash@row=r0006" in bad["error"][0]
    ok = df.filter(pl.col("status") == "ok")
    # the neighbours it took down, run again in batches or alone, keep their texts
    assert dict(zip(ok["id"], ok["text"])) == {k: v for k, v in clean.items() if k != "r0006"}
    report = _report(job)
    assert report["engine_restarts"] == 3  # two failures in a batch, one alone
    assert report["error_types"]["engine_error"]["sample_ids"] == ["r0006"]

    # A rerun of the finished job finds nothing to do without loading a model.
    def no_model(*args, **kwargs):
        raise AssertionError("a finished job must not load the model")

    monkeypatch.setattr(run_module, "load_llm", no_model)
    (job.parent / "run" / "report.json").unlink()
    outcome = run_job(load_job(job), job, progress=_Quiet())
    assert outcome.exit_code == EXIT_SOME_ERRORS, outcome.message
    assert _report(job)["exit_code"] == EXIT_SOME_ERRORS  # the report was rewritten


def test_an_engine_that_never_works_stops_with_exit_5_and_resumes(clean, tiny_model_dir, tmp_path):
    job = _write_job(tiny_model_dir, tmp_path)
    proc = _run(job, "crash@step=every")
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(
        "stopped: the engine failed and 3 rebuilds in a row failed too, without finishing a row"
    )
    assert "crash@step=every" in last and f"resume with `batchgen run {job}`" in last
    report = _report(job)
    assert report["exit_code"] == 5
    assert report["engine_restarts"] == 3  # each rebuilt engine failed at its first step
    assert [f["event"] for f in report["engine_faults"]][-1] == "gave_up"
    # No row was condemned for the engine's failure.
    assert not list((job.parent / "run" / "results").glob("*.parquet"))

    outcome = run_job(load_job(job), job, progress=_Quiet())  # no fault in this process
    assert outcome.exit_code == EXIT_OK, outcome.message
    df = _results(job)
    assert df["id"].to_list() == IDS
    assert dict(zip(df["id"], df["text"])) == clean


def test_a_rerun_of_a_finished_job_loads_no_model(clean, tiny_model_dir, tmp_path, monkeypatch):
    job = _write_job(tiny_model_dir, tmp_path)
    assert run_job(load_job(job), job, progress=_Quiet()).exit_code == EXIT_OK
    parts = sorted(p.name for p in (tmp_path / "run" / "results").iterdir())

    monkeypatch.setattr(run_module, "load_llm", lambda *a, **k: pytest.fail("model loaded"))
    outcome = run_job(load_job(job), job, progress=_Quiet())
    assert outcome.exit_code == EXIT_OK and outcome.message.startswith("done: 24 rows ok")
    assert sorted(p.name for p in (tmp_path / "run" / "results").iterdir()) == parts
    assert (tmp_path / "run" / "_SUCCESS").exists()

    # A row missing from the results (its part lost) is work again: the model is needed.
    shutil.rmtree(tmp_path / "run" / "results")
    (tmp_path / "run" / "results").mkdir()
    with pytest.raises(pytest.fail.Exception, match="model loaded"):
        run_job(load_job(job), job, progress=_Quiet())


def test_a_malformed_fault_spec_is_refused_before_any_work(tiny_model_dir, tmp_path):
    job = _write_job(tiny_model_dir, tmp_path)
    proc = _run(job, "oom@step=5,crash@row", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {ENV_VAR}: cannot parse 'crash@row'; expected oom@step=N, crash@step=N, "
        "crash@step=every or crash@row=ID (comma-separated)"
    )
    assert not (tmp_path / "run").exists()


def test_a_restart_frees_the_failed_engine_before_building_the_next(
    tiny_model_dir, tmp_path, monkeypatch
):
    from batchgen.engine_faults import EngineFaultLog
    from batchgen.engine_supervisor import EngineFailure, EngineSupervisor
    from engine import Request, SamplingParams

    monkeypatch.setenv(ENV_VAR, "crash@step=2")
    job = load_job(_write_job(tiny_model_dir, tmp_path))
    first = run_module.load_llm(job)
    failed = weakref.ref(first.engine)
    seen = []

    def build(max_num_seqs):
        seen.append(failed())  # what is left of the failed engine when the next is built
        return run_module.load_llm(job, max_num_seqs=max_num_seqs)

    sup = EngineSupervisor(first, build, lambda old: None, EngineFaultLog(tmp_path))
    del first
    request = Request("0:0", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), tag="r")
    with pytest.raises(EngineFailure) as info:
        list(sup.stream([request]))
    fault = info.value.fault
    del info
    assert fault.in_step == {"0:0"}
    sup.restart(fault)
    assert seen == [None]
    assert [out.request_id for out in sup.stream([request])] == ["0:0"]  # fired once
