"""Progress before the first generation of a `cluster: auto` job: embedding, clustering and
assigning report their counts, rate and ETA (JSON lines without a terminal, a rich bar on
one, progress.json either way), and `validate` counts the embedding pass in its estimate."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

from click.testing import CliRunner

from batchgen.cli import main
from batchgen.job_context import open_job
from batchgen.job_spec import load_job
from batchgen.progress import PhaseMeter, Progress
from batchgen.task_clusters import (
    ClusterSettings,
    build_task_clusters,
    estimate_embedding,
    settings_for_job,
)
from tests.batchgen.conftest import write_job, write_parquet
from tests.clustering.conftest import HashEmbedder
from tests.clustering.mixed_tasks import mixed_task_rows

_CLI = [sys.executable, "-c", "from batchgen.cli import main; main()"]


def _phases(events: list[str]) -> list[str]:
    return [p for i, p in enumerate(events) if i == 0 or p != events[i - 1]]


def test_each_pass_reports_its_phase_in_order(tmp_path):
    rows = [(f"id{i:03d}", None if i % 10 == 3 else f"task {i % 3} item {i}") for i in range(60)]
    calls: list[tuple[str, int, int | None]] = []
    build_task_clusters(
        iter(rows),
        tmp_path,
        ClusterSettings(min_cluster_size=5, max_k=6),
        embedder=HashEmbedder(),
        chunk_rows=16,
        on_progress=lambda phase, done, total: calls.append((phase, done, total)),
        total_rows=len(rows),
    )
    assert _phases([c[0] for c in calls]) == ["embedding", "clustering", "assigning"]
    embedding = [(done, total) for phase, done, total in calls if phase == "embedding"]
    assert embedding[0] == (0, 60) and embedding[-1] == (60, 60)  # rows without text count
    assert [d for d, _ in embedding] == sorted(d for d, _ in embedding)
    k_tried = [(done, total) for phase, done, total in calls if phase == "clustering"]
    assert k_tried[-1][0] >= 1 and k_tried[-1][0] <= k_tried[-1][1]  # k = 2 .. 6: 5 values
    assigning = [(done, total) for phase, done, total in calls if phase == "assigning"]
    assert assigning[0] == (0, 60) and assigning[-1] == (60, 60)


def test_phase_meter_rate_and_eta_follow_the_recent_window():
    meter = PhaseMeter("embedding", total=1000, now=0.0)
    meter.advance_to(500, now=1.0)  # found in the embedding cache: fast
    meter.advance_to(600, now=41.0)  # then 100 rows in 40 s through the model
    snap = meter.snapshot(now=41.0)
    # The cache burst has left the 30 s window: the rate is the model's, 2.5 rows/s.
    assert snap["rows_s"] == 2.5 and snap["eta_s"] == 160.0
    assert snap["phase"] == "embedding" and snap["rows_embedded"] == 600
    assert snap["rows_total"] == 1000 and snap["elapsed_s"] == 41.0


def test_json_lines_and_progress_file_name_the_phase(tmp_path):
    stream = io.StringIO()
    progress_file = tmp_path / "progress.json"
    progress = Progress(progress_file, interval=3600, tty=False, stream=stream)
    progress.phase("embedding", 0, 200)
    assert json.loads(progress_file.read_text())["phase"] == "embedding"
    progress.phase("embedding", 50, 200)  # inside the interval: not shown
    progress.phase("embedding", 200, 200)  # the last row of a phase always is
    progress.phase("clustering", 0, 5)
    lines = [json.loads(line)["progress"] for line in stream.getvalue().splitlines()]
    assert [line["phase"] for line in lines] == ["embedding", "embedding", "clustering"]
    assert lines[1]["rows_embedded"] == 200 and lines[1]["rows_total"] == 200
    assert {"rows_s", "eta_s", "elapsed_s"} <= set(lines[1])
    assert lines[2]["k_tried"] == 0 and lines[2]["k_candidates"] == 5
    assert json.loads(progress_file.read_text())["phase"] == "clustering"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_for_the_embedding_phase():
    stream = _Terminal()
    progress = Progress(None, stream=stream)
    progress.phase("embedding", 0, 400)
    time.sleep(0.3)  # the display redraws a few times a second
    progress.phase("embedding", 100, 400)
    progress.close()
    shown = stream.getvalue()
    assert "embedding" in shown and "100 / 400 rows" in shown and "ETA" in shown
    assert "━" in shown  # the bar


def _auto_job(tmp_path, tiny_model_dir, rows):
    data = write_parquet(tmp_path / "in.parquet", rows)
    job = {
        "input": {"path": str(data)},
        "prompt": {"template": "{{ prompt }}"},
        "model": {"path": str(tiny_model_dir)},
        "sampling": {"temperature": 0.0, "max_tokens": 2},
        "batching": {"cluster": "auto", "max_num_seqs": 8},
        "output": {"path": str(tmp_path / "run"), "rows_per_part": 40},
    }
    return write_job(tmp_path / "job.yaml", job)


def test_run_shows_the_phases_before_generation(tiny_model_dir, tmp_path):
    rows = mixed_task_rows(per_task=16, tasks=4)
    job = _auto_job(tmp_path, tiny_model_dir, rows)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(
        [*_CLI, "run", str(job), "--progress-interval", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [
        json.loads(line)["progress"]
        for line in run.stderr.splitlines()
        if line[:12] == '{"progress":'
    ]
    phases = _phases([line["phase"] for line in lines])
    assert phases == ["embedding", "clustering", "assigning", "generating"]
    embedding = [line for line in lines if line["phase"] == "embedding"]
    assert embedding[-1]["rows_embedded"] == embedding[-1]["rows_total"] == len(rows)
    assert embedding[-1]["rows_s"] > 0
    assigning = [line for line in lines if line["phase"] == "assigning"]
    assert assigning[-1]["rows_assigned"] == len(rows)
    final = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert final["phase"] == "generating" and final["rows_done"] == len(rows)


class _SlowEmbedder(HashEmbedder):
    """2 ms a text: 500 rows/s."""

    def embed(self, texts):
        time.sleep(0.002 * len(texts))
        return super().embed(texts)


def test_validate_estimate_includes_the_embedding_pass(tiny_model_dir, tmp_path):
    rows = mixed_task_rows(per_task=20, tasks=2)
    job_path = _auto_job(tmp_path, tiny_model_dir, rows)
    job = load_job(job_path)
    ctx = open_job(job)
    clusters_dir = tmp_path / "run" / "clusters"
    estimate = estimate_embedding(
        job, ctx.input.rows(), 200_000, clusters_dir, embedder=_SlowEmbedder()
    )
    assert estimate.rows == 200_000
    assert 250 < estimate.rows_s < 520  # 500 rows/s less the timer's and hashing's share
    assert 200_000 / 520 < estimate.seconds < 200_000 / 250 + 5

    out = CliRunner().invoke(main, ["validate", str(job_path)])
    assert out.exit_code == 0, out.output
    assert f"embedding (cluster: auto): {len(rows)} rows at" in out.output
    assert "included in the estimate" in out.output and "estimated time" in out.output

    # A run whose clusters are stored embeds nothing: nothing to add.
    texts = ((r["id"], r["prompt"]) for r in rows)
    build_task_clusters(texts, clusters_dir, settings_for_job(job), embedder=HashEmbedder())
    stored = estimate_embedding(job, ctx.input.rows(), len(rows), clusters_dir)
    assert stored.rows == 0 and stored.seconds == 0.0
