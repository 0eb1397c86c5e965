"""`cluster: auto` in the run loop: rows reach the engine cluster by cluster (largest
first, longest prompt first inside a window), carry their cluster as Request.group and as
the result's cluster_id, and a resumed run reloads the stored clusters without embedding."""

from __future__ import annotations

import json
import logging

import polars as pl

from batchgen.job_spec import parse_job
from batchgen.progress import Progress
from batchgen.run import EXIT_INTERRUPTED, EXIT_OK, run_job
from tests.batchgen.conftest import FakeLLM
from tests.batchgen.test_run_loop import _Null
from tests.clustering.mixed_tasks import mixed_task_rows


class RecordingLLM(FakeLLM):
    """FakeLLM that remembers the order and group of every request it pulled, and can stop
    like a second Ctrl-C after `stop_after` outputs."""

    def __init__(self, stop_after: int | None = None, spill_dir=None):
        super().__init__()
        self.seen: list[tuple[str, int | None, int]] = []  # (seq, group, prompt tokens)
        self.stop_after = stop_after
        self.spill_dir = spill_dir
        self.spilled_at_first: list[str] | None = None  # the planner's buckets by then

    def stream(self, requests):
        def recorded():
            for req in requests:
                if not self.seen and self.spill_dir is not None:
                    self.spilled_at_first = sorted(p.name for p in self.spill_dir.glob("*"))
                self.seen.append((req.request_id.split(":")[0], req.group, len(req.prompt)))
                yield req

        for i, out in enumerate(super().stream(recorded())):
            if self.stop_after is not None and i == self.stop_after:
                raise KeyboardInterrupt
            yield out


def _run(job: dict, path, llm):
    progress = Progress(None, tty=False, interval=3600, stream=_Null())
    return run_job(parse_job(job), path, llm=llm, progress=progress)


def _job(make_job, rows):
    return make_job(
        rows=rows,
        prompt={"template": "{{ prompt }}"},
        # prefix caching off: its window order (rows sharing a prefix first) is
        # tests/batchgen/test_prefix_caching_run.py's; here windows go longest first
        batching={"cluster": "auto", "max_num_seqs": 8, "plan_window": 16, "prefix_caching": False},
        output={"rows_per_part": 16},
    )


def test_auto_feeds_cluster_by_cluster_and_resumes_without_embedding(make_job, tmp_path, caplog):
    rows = mixed_task_rows(per_task=20, tasks=4)  # 80 prompts, 4 tasks, interleaved
    job, path = _job(make_job, rows)
    caplog.set_level(logging.INFO, logger="batchgen.task_clusters")
    first = RecordingLLM(stop_after=30, spill_dir=tmp_path / "run" / "plan")
    assert _run(job, path, first).exit_code == EXIT_INTERRUPTED
    assert "embedded 80 texts" in caplog.text

    assignments = pl.read_parquet(tmp_path / "run" / "clusters" / "assignments.parquet")
    assert assignments["id"].to_list() == [r["id"] for r in rows]  # input order, every row
    sizes = assignments.group_by("cluster_id").len().sort("len", descending=True)
    groups = [g for _, g, _ in first.seen]
    # Fed cluster by cluster: the group changes only when a cluster is exhausted, and
    # the first cluster fed is the largest.
    runs = [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
    assert len(runs) == len(set(runs))
    assert groups[0] == sizes["cluster_id"][0]
    # The largest cluster is fed as the input is read, not spilled first: when the engine
    # took its first request, it had no bucket (spilling everything flushes every bucket
    # to its file before the first row goes out).
    assert f"group-{groups[0]}.pkl" not in first.spilled_at_first
    # Inside each planner window of 16 rows of one cluster: longest prompt first.
    first_window = [n for _, _, n in first.seen[:16]]
    assert first_window == sorted(first_window, reverse=True)

    caplog.clear()
    second = RecordingLLM()
    assert _run(job, path, second).exit_code == EXIT_OK
    assert "embedded" not in caplog.text and "reloaded" in caplog.text
    results = pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")
    assert sorted(results["id"].to_list()) == sorted(r["id"] for r in rows)
    joined = results.join(assignments, on="id", suffix="_assigned")
    assert (joined["cluster_id"] == joined["cluster_id_assigned"]).all()
    report = (tmp_path / "run" / "report.md").read_text()
    assert assignments["cluster_name"][0] in report and "### Per cluster" in report
    per_cluster = json.loads((tmp_path / "run" / "report.json").read_text())["per_cluster"]
    assert sum(c["size"] for c in per_cluster) == sum(c["rows"] for c in per_cluster) == 80
    by_id = {c["cluster_id"]: c for c in per_cluster}
    for cluster_id, size in zip(sizes["cluster_id"], sizes["len"]):
        assert by_id[cluster_id]["size"] == size
        assert by_id[cluster_id]["completion_tokens"] == 4 * size  # max_tokens 4, n 1
