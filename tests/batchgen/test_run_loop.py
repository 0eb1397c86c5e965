"""The run loop's own logic (parts, manifest, resume, order, budget, n) over a fake engine;
the real engine runs in test_end_to_end.py."""

from __future__ import annotations

import json

import polars as pl
import pytest

from batchgen.job_spec import JobError, parse_job
from batchgen.progress import Progress
from batchgen.run import EXIT_BUDGET_EXCEEDED, EXIT_INTERRUPTED, EXIT_OK, EXIT_SOME_ERRORS, run_job
from batchgen.run_dir import RunDir
from tests.batchgen.conftest import FakeLLM, sentence_rows


def _run(job: dict, job_path, llm, **kwargs):
    progress = Progress(None, tty=False, interval=3600, stream=_Null())
    return run_job(parse_job(job), job_path, llm=llm, progress=progress, **kwargs)


class _Null:
    def write(self, _):
        pass

    def flush(self):
        pass

    def isatty(self):
        return False


def _results(tmp_path) -> pl.DataFrame:
    return pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")


def test_every_id_once_parts_committed_in_manifest(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(35))
    outcome = _run(job, path, FakeLLM())
    assert outcome.exit_code == EXIT_OK
    df = _results(tmp_path)
    assert sorted(df["id"].to_list()) == [f"r{i:04d}" for i in range(35)]
    assert set(df["status"]) == {"ok"}
    run_dir = RunDir(tmp_path / "run")
    parts = [e.part for e in run_dir.live_parts()]
    assert sorted(p.name for p in run_dir.results.iterdir()) == sorted(parts)
    assert sum(e.rows for e in run_dir.live_parts()) == 35
    assert (tmp_path / "run" / "_SUCCESS").exists()
    # Provenance and the carried input column (renamed: `text` is a result column).
    assert df["model"].unique().to_list() == ["fake"]
    assert df["job_fingerprint"].unique().to_list() == [parse_job(job).fingerprint]
    assert "input_text" in df.columns and "lang" in df.columns


class _InterruptingLLM(FakeLLM):
    """Delivers `after` outputs, then behaves like a second Ctrl-C."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def stream(self, requests):
        for i, out in enumerate(super().stream(requests)):
            if i == self.after:
                raise KeyboardInterrupt
            yield out


def test_interrupt_then_resume_skips_committed_rows(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(50))
    first = _run(job, path, _InterruptingLLM(after=23))
    assert first.exit_code == EXIT_INTERRUPTED
    assert not (tmp_path / "run" / "_SUCCESS").exists()
    committed = set(_results(tmp_path)["id"].to_list())
    assert 20 <= len(committed) <= 23  # the finished rows were written, nothing more
    second_llm = FakeLLM()
    second = _run(job, path, second_llm)
    assert second.exit_code == EXIT_OK
    ids = _results(tmp_path)["id"].to_list()
    assert sorted(ids) == [f"r{i:04d}" for i in range(50)]  # each exactly once
    assert second_llm.pulled == 50 - len(committed)  # committed rows not recomputed


def test_output_order_input(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(45), output={"order": "input", "rows_per_part": 7})
    assert _run(job, path, FakeLLM(order_seed=3)).exit_code == EXIT_OK
    run_dir = RunDir(tmp_path / "run")
    ids = []
    for entry in run_dir.live_parts():
        ids += pl.read_parquet(run_dir.results / entry.part)["id"].to_list()
    assert ids == [f"r{i:04d}" for i in range(45)]


def test_changed_job_refused_unless_new_run(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(12))
    assert _run(job, path, FakeLLM()).exit_code == EXIT_OK
    job["sampling"]["temperature"] = 0.7
    with pytest.raises(JobError, match=r"sampling\.temperature"):
        _run(job, path, FakeLLM())
    # A change that does not alter outputs (part size) resumes the same run.
    job["sampling"]["temperature"] = 0.0
    job["output"]["rows_per_part"] = 3
    assert _run(job, path, FakeLLM()).exit_code == EXIT_OK
    job["sampling"]["temperature"] = 0.7
    outcome = _run(job, path, FakeLLM(), new_run=True)
    assert outcome.exit_code == EXIT_OK
    assert "previous run moved to" in outcome.message
    assert len(list(tmp_path.glob("run.*"))) == 1  # the old run kept aside


def test_error_rows_budget_and_retry_errors(make_job, tmp_path):
    rows = sentence_rows(20)
    for i in (3, 7):
        rows[i]["text"] = None  # null prompt -> error row
    rows[11]["text"] = "   \n "  # blank prompt -> error row
    job, path = make_job(rows=rows, errors={"budget": 0.2})
    outcome = _run(job, path, FakeLLM())
    assert outcome.exit_code == EXIT_SOME_ERRORS
    df = _results(tmp_path)
    errors = df.filter(pl.col("status") == "error").sort("id")
    assert errors["id"].to_list() == ["r0003", "r0007", "r0011"]
    assert errors["error_type"].to_list() == ["null_input", "null_input", "empty_prompt"]
    mirror = pl.read_parquet(tmp_path / "run" / "errors" / "*.parquet")
    assert sorted(mirror["id"].to_list()) == ["r0003", "r0007", "r0011"]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["error_types"]["null_input"]["count"] == 2
    assert report["status"] == {"ok": 17, "error": 3}

    # Fix the data and retry only the failed rows: every id once, all ok.
    for i in (3, 7, 11):
        rows[i]["text"] = f"fixed row {i}"
    from tests.batchgen.conftest import write_parquet

    write_parquet(tmp_path / "input.parquet", rows)
    retry_llm = FakeLLM()
    outcome = _run(job, path, retry_llm, retry_errors=True)
    assert outcome.exit_code == EXIT_OK
    assert retry_llm.pulled == 3
    df = _results(tmp_path)
    assert sorted(df["id"].to_list()) == [f"r{i:04d}" for i in range(20)]
    assert set(df["status"]) == {"ok"}
    assert not list((tmp_path / "run" / "errors").iterdir())


def test_budget_exceeded_stops_with_exit_4(make_job, tmp_path):
    rows = [{**r, "text": None if i % 2 else r["text"]} for i, r in enumerate(sentence_rows(60))]
    job, path = make_job(rows=rows, errors={"budget": 0.1})
    outcome = _run(job, path, FakeLLM())
    assert outcome.exit_code == EXIT_BUDGET_EXCEEDED
    assert not (tmp_path / "run" / "_SUCCESS").exists()
    assert len(_results(tmp_path)) < 60  # stopped early


def test_n_completions_have_their_own_seeds(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(6), sampling={"n": 3, "temperature": 0.9})
    assert _run(job, path, FakeLLM()).exit_code == EXIT_OK
    df = _results(tmp_path)
    assert len(df) == 18
    for _, group in df.group_by("id"):
        assert sorted(group["n_index"].to_list()) == [0, 1, 2]
        assert group["seed"].n_unique() == 3
        assert group["text"].n_unique() == 3


def test_memory_stays_bounded_by_lookahead(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(300), batching={"plan_window": 16})
    llm = FakeLLM(max_num_seqs=4)
    assert _run(job, path, llm).exit_code == EXIT_OK
    assert llm.max_waiting <= 8  # the engine pulled lazily; the pipeline never pushed ahead
