"""The run directory checks itself on resume, with real `batchgen run` processes: a lost
manifest is rebuilt from the parts' own metadata, a damaged or missing part is reported by
name, moved to quarantine/ and only its rows run again, an uncommitted part that verifies
is adopted, a stray one is quarantined, never deleted; `report --verify` says the same
without changing anything. Ids are integers here: they stay int64 in the results."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.part_check import METADATA_KEY
from tests.batchgen.run_process import int_id_rows, job_file, manifest, results, run

ROWS = 40  # 4 parts of 10


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished run of ROWS integer ids, made once; each test works on a copy."""
    base = tmp_path_factory.mktemp("finished")
    job = job_file(tiny_model_dir, base, int_id_rows(ROWS), base / "run")
    done = run(job)
    assert done.returncode == 0, done.stdout + done.stderr
    return base


@pytest.fixture
def copy(finished, tmp_path) -> tuple[Path, Path]:
    """(job file, run dir): the finished run copied, and a job pointing at the copy."""
    run_path = tmp_path / "run"
    shutil.copytree(finished / "run", run_path)
    job = (finished / "job.yaml").read_text().replace(str(finished / "run"), str(run_path))
    (tmp_path / "job.yaml").write_text(job)
    return tmp_path / "job.yaml", run_path


def _verify(run_path: Path):
    return CliRunner().invoke(main, ["report", str(run_path), "--verify"])


def _files(run_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_path / "results").iterdir())}


def _every_id_once(run_path: Path) -> pl.DataFrame:
    df = results(run_path)
    assert df.schema["id"] == pl.Int64  # an integer id column stays integer
    assert sorted(df["id"].to_list()) == list(range(ROWS))
    assert set(df["status"]) == {"ok"}
    return df


def test_finished_run_verifies_and_keeps_integer_ids(finished):
    outcome = _verify(finished / "run")
    assert outcome.exit_code == 0, outcome.output
    assert "verified: 4 parts, 40 result rows" in outcome.output
    _every_id_once(finished / "run")
    for line in manifest(finished / "run"):
        path = finished / "run" / "results" / line["part"]
        assert line["bytes"] == path.stat().st_size
        assert line["checksum"].startswith("sha256:")
        meta = json.loads(pq.read_metadata(path).metadata[METADATA_KEY])
        assert meta["part"] == line["part"] and meta["rows"] == line["rows"] == 10
        assert (
            meta["fingerprint"]
            == json.loads((finished / "run" / "job.json").read_text())["fingerprint"]
        )


def test_lost_manifest_is_rebuilt_from_the_parts(copy):
    job, run_path = copy
    before = _files(run_path)
    lines = manifest(run_path)
    (run_path / "_manifest.jsonl").unlink()
    assert _verify(run_path).exit_code == 2  # not whole, and nothing moved by looking
    assert _files(run_path) == before

    rerun = run(job)
    assert rerun.returncode == 0, rerun.stderr
    assert "_manifest.jsonl is missing: rebuilt it from the 4 parts" in rerun.stderr
    assert _files(run_path) == before  # no part regenerated, none moved
    assert [(e["part"], e["checksum"]) for e in manifest(run_path)] == [
        (e["part"], e["checksum"]) for e in lines
    ]
    assert not (run_path / "quarantine").exists()
    _every_id_once(run_path)


def test_damaged_and_missing_parts_are_quarantined_and_only_their_rows_rerun(copy):
    job, run_path = copy
    part = {n: run_path / "results" / f"part-0000{n}.parquet" for n in (1, 2, 3, 4)}
    damaged_ids = set()
    for n in (1, 2, 4):
        damaged_ids |= set(pl.read_parquet(part[n])["id"].to_list())
    # 200 bytes of garbage inside part 1, its footer intact; part 2 cut to half; part 4 gone.
    data = bytearray(part[1].read_bytes())
    middle = len(data) // 2
    data[middle : middle + 200] = os.urandom(200)
    part[1].write_bytes(bytes(data))
    garbled = bytes(data)
    half = part[2].read_bytes()[: part[2].stat().st_size // 2]
    part[2].write_bytes(half)
    part[4].unlink()
    intact = part[3].read_bytes()

    check = _verify(run_path)
    assert check.exit_code == 2
    for n in (1, 2, 4):
        assert f"part-0000{n}.parquet: DAMAGED" in check.output
    assert "part-00003.parquet: ok" in check.output
    assert part[1].exists() and part[2].exists()  # --verify moves nothing
    report = CliRunner().invoke(main, ["report", str(run_path)])
    assert report.exit_code == 2 and isinstance(report.exception, SystemExit)
    assert "--verify` names the damaged parts" in report.output

    rerun = run(job)
    assert rerun.returncode == 0, rerun.stderr
    assert "Traceback" not in rerun.stderr
    for n in (1, 2, 4):
        assert f"part part-0000{n}.parquet is damaged" in rerun.stderr
    assert "part-00004.parquet is damaged: missing" in rerun.stderr
    # The damaged files are kept, as they were, in quarantine/.
    quarantined = {p.name: p.read_bytes() for p in (run_path / "quarantine").rglob("part-*")}
    assert quarantined == {"part-00001.parquet": garbled, "part-00002.parquet": half}
    assert part[3].read_bytes() == intact
    # Only the damaged parts' ids ran again, into new parts.
    new_parts = [e for e in manifest(run_path) if e["part"] != "part-00003.parquet"]
    new_ids = set()
    for e in new_parts:
        new_ids |= set(pl.read_parquet(run_path / "results" / e["part"])["id"].to_list())
    assert new_ids == damaged_ids and sum(e["rows"] for e in new_parts) == len(damaged_ids)
    # A new part never takes the name of one that was damaged or missing.
    assert all(int(e["part"][5:10]) > 4 for e in new_parts)
    _every_id_once(run_path)
    assert _verify(run_path).exit_code == 0


def test_uncommitted_part_is_adopted_and_strays_are_quarantined(copy, tmp_path):
    job, run_path = copy
    lines = (run_path / "_manifest.jsonl").read_text().splitlines(keepends=True)
    # The process stopped after renaming part 4 into place, before appending its line.
    (run_path / "_manifest.jsonl").write_text("".join(lines[:3]))
    # A part of another job (its metadata names another fingerprint) and an unfinished write.
    table = pq.read_table(run_path / "results" / "part-00001.parquet")
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    meta.update(fingerprint="0123456789abcdef", part="part-00009.parquet")
    stray = run_path / "results" / "part-00009.parquet"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta)}), stray)
    stray_bytes = stray.read_bytes()
    (run_path / "results" / ".part-00010.parquet.tmp").write_bytes(b"PAR1 half a part")
    before = _files(run_path)

    check = _verify(run_path)
    assert check.exit_code == 2
    assert "part-00004.parquet: NOT COMMITTED: it verifies" in check.output
    assert "results/part-00009.parquet: DOES NOT COUNT: written by another job" in check.output

    rerun = run(job)
    assert rerun.returncode == 0, rerun.stderr
    assert "part part-00004.parquet was written but its manifest line was not" in rerun.stderr
    assert "results/part-00009.parquet does not count (written by another job" in rerun.stderr
    assert [e["part"] for e in manifest(run_path)] == [f"part-0000{n}.parquet" for n in range(1, 5)]
    after = _files(run_path)
    assert after == {
        k: v for k, v in before.items() if k.startswith("part-0000") and k < "part-00005"
    }
    (moved,) = (run_path / "quarantine").rglob("part-00009.parquet")
    assert moved.read_bytes() == stray_bytes
    _every_id_once(run_path)


def test_manifest_lines_without_checksums_still_resume(copy):
    job, run_path = copy
    # Lines as written before parts were checksummed: such parts are verified by a full read.
    old = []
    for e in manifest(run_path):
        e.pop("bytes")
        e.pop("checksum")
        old.append(json.dumps(e) + "\n")
    (run_path / "_manifest.jsonl").write_text("".join(old))
    part2 = run_path / "results" / "part-00002.parquet"
    part2.write_bytes(part2.read_bytes()[: part2.stat().st_size // 2])
    before = _files(run_path)

    rerun = run(job)
    assert rerun.returncode == 0, rerun.stderr
    assert "part part-00002.parquet is damaged: unreadable" in rerun.stderr
    after = _files(run_path)
    for name in ("part-00001.parquet", "part-00003.parquet", "part-00004.parquet"):
        assert after[name] == before[name]  # good old parts kept, not regenerated
    # The manifest now carries every part's size and checksum.
    assert all(e["checksum"] and e["bytes"] for e in manifest(run_path))
    _every_id_once(run_path)
    assert _verify(run_path).exit_code == 0
