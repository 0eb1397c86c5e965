"""The run directory's self-check on the cases a real run rarely produces, over a fake
engine: a --retry-errors rewrite whose manifest line was never appended, a manifest line
garbled in the middle, two live parts holding the same ids (what two unlocked runs left)."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.job_spec import parse_job
from batchgen.progress import Progress
from batchgen.run import run_job
from batchgen.run_dir import RunDir
from batchgen.run_dir_check import survey
from tests.batchgen.conftest import FakeLLM, sentence_rows, write_parquet


def _run(job: dict, path, llm=None, **kwargs):
    progress = Progress(None, tty=False, interval=3600)
    return run_job(parse_job(job), path, llm=llm or FakeLLM(), progress=progress, **kwargs)


def _ids(run_dir: RunDir) -> list[str]:
    return sorted(pl.read_parquet(run_dir.results / "*.parquet")["id"].to_list())


def test_retry_rewrite_without_its_line_is_adopted_and_replaces(make_job, tmp_path):
    rows = sentence_rows(20)
    rows[3]["text"] = None  # an error row in part 1
    job, path = make_job(rows=rows)
    assert _run(job, path).exit_code == 3
    rows[3]["text"] = "fixed"
    write_parquet(tmp_path / "input.parquet", rows)
    run_dir = RunDir(tmp_path / "run")
    # --retry-errors wrote the rewrite and its line, then moved the old part to quarantine.
    # Undo the last two steps, as if the process had died right after the rewrite's rename.
    retry = FakeLLM(max_num_seqs=1)
    retry.stream = lambda requests: iter(())  # commits the rewrite, then runs nothing
    assert _run(job, path, retry, retry_errors=True).exit_code == 5
    lines = run_dir.manifest.read_text().splitlines(keepends=True)
    rewrite = json.loads(lines[-1])
    assert rewrite["replaces"]
    run_dir.manifest.write_text("".join(lines[:-1]))
    for moved in run_dir.quarantine_dir.rglob("part-*.parquet"):
        shutil.move(moved, run_dir.path / moved.parent.name / moved.name)

    found = survey(run_dir, parse_job(job).fingerprint)
    assert [e.part for e in found.adopted] == [rewrite["part"]]
    assert [p.name for p in found.replaced] == [rewrite["replaces"]]
    llm = FakeLLM()
    assert _run(job, path, llm).exit_code == 0
    assert llm.pulled == 1  # only the error row ran again
    assert _ids(run_dir) == [f"r{i:04d}" for i in range(20)]
    assert not (run_dir.results / rewrite["replaces"]).exists()
    assert not list(run_dir.errors.iterdir())


def test_garbled_manifest_line_is_repaired_from_the_parts(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(30))
    assert _run(job, path).exit_code == 0
    run_dir = RunDir(tmp_path / "run")
    lines = run_dir.manifest.read_text().splitlines(keepends=True)
    lines[1] = '{"part": "part-00002.par\x00\x00\n'
    run_dir.manifest.write_text("".join(lines))
    found = survey(run_dir, parse_job(job).fingerprint)
    assert found.manifest.damaged == ["line 2 is not a manifest entry"]
    assert [e.part for e in found.adopted] == ["part-00002.parquet"]
    llm = FakeLLM()
    assert _run(job, path, llm).exit_code == 0
    assert llm.pulled == 0
    assert [e.part for e in run_dir.entries()] == [
        "part-00001.parquet",
        "part-00003.parquet",
        "part-00002.parquet",
    ]
    assert survey(run_dir, parse_job(job).fingerprint).clean
    # The manifest as it was is kept.
    (kept,) = run_dir.quarantine_dir.rglob("_manifest.jsonl")
    assert kept.read_text() == "".join(lines)


def test_live_parts_holding_the_same_ids_keep_the_first(make_job, tmp_path):
    job, path = make_job(rows=sentence_rows(20))
    assert _run(job, path).exit_code == 0
    run_dir = RunDir(tmp_path / "run")
    first = run_dir.entries()[0]
    # A second copy of part 1 committed under another name, as an unlocked run could.
    shutil.copy(run_dir.results / first.part, run_dir.results / "part-00007.parquet")
    run_dir.append_manifest(type(first)(**{**first.__dict__, "part": "part-00007.parquet"}))
    assert len(pl.read_parquet(run_dir.results / "*.parquet")) == 30
    found = survey(run_dir, parse_job(job).fingerprint)
    assert [(e.part, r.split(" (")[0]) for e, r in found.damaged] == [
        ("part-00007.parquet", "holds ids part-00001.parquet holds")
    ]
    assert _run(job, path, FakeLLM()).exit_code == 0
    assert _ids(run_dir) == [f"r{i:04d}" for i in range(20)]  # every id once again


class _StopAfter(FakeLLM):
    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def stream(self, requests):
        for i, out in enumerate(super().stream(requests)):
            if i == self.after:
                raise KeyboardInterrupt
            yield out


def test_resume_writes_ids_of_the_type_already_committed(make_job, tmp_path):
    rows = [{**r, "id": i} for i, r in enumerate(sentence_rows(30))]
    job, path = make_job(rows=rows)
    assert _run(job, path, _StopAfter(after=12)).exit_code == 5
    run_dir = RunDir(tmp_path / "run")
    # The parts as a version that wrote every id as text left them: string ids, lines
    # without size and checksum.
    lines = []
    for entry in run_dir.entries():
        table = pq.read_table(run_dir.results / entry.part)
        ids = pc.cast(table["id"], pa.string())
        table = table.set_column(0, pa.field("id", pa.string(), False), ids)
        pq.write_table(table, run_dir.results / entry.part)
        lines.append({k: v for k, v in entry.__dict__.items() if k not in ("bytes", "checksum")})
    run_dir.manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    llm = FakeLLM()
    assert _run(job, path, llm).exit_code == 0
    assert llm.pulled == 30 - sum(
        line["rows"] for line in lines
    )  # "7" committed matches the int 7 of the input
    df = pl.read_parquet(run_dir.results / "*.parquet")  # one id type across all parts
    assert df.schema["id"] == pl.String
    assert sorted(df["id"].to_list(), key=int) == [str(i) for i in range(30)]
