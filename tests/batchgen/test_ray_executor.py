"""The Ray executor on a local Ray cluster started here (2 CPUs, 2 workers, the tiny
model): every id exactly once with texts equal to the local executor's, greedy and
seeded; a worker killed mid-run (its process, by pid) and the job still completes exactly
once; the driver killed with kill -9 and the rerun completes exactly once.

One cluster serves the module; each run starts its own actor pool."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchgen.cli.report import report_cmd
from batchgen.job_spec import JobError, load_job, parse_job
from batchgen.run import run_job
from tests.batchgen.batch_files import batch_job, openai_chat, write_jsonl
from tests.batchgen.run_process import int_id_rows, job_file, manifest, results, start

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ROWS = 60
RAY_EXECUTOR = {"type": "ray", "num_workers": 2, "resources_per_worker": {"CPU": 1}}


@pytest.fixture(scope="module")
def ray_cluster():
    # ray.init leaves its SIGTERM handler installed after shutdown: later tests in this
    # process check the run's own signal handling
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    # address "local": a new cluster even when another one on this machine is (or was) running
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    for s, handler in saved.items():
        signal.signal(s, handler)


def _jobs(model_dir: Path, root: Path, rows=None, **sections) -> tuple[Path, Path]:
    """The same job twice, local and on Ray, over one input, in their own run dirs."""
    rows = rows or int_id_rows(ROWS)
    local = job_file(model_dir, _dir(root / "local"), rows, root / "local" / "run", **sections)
    on_ray = job_file(
        model_dir,
        _dir(root / "ray"),
        rows,
        root / "ray" / "run",
        executor=RAY_EXECUTOR,
        **sections,
    )
    return local, on_ray


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run_in_process(job_path: Path):
    job = load_job(job_path)
    if job.executor.type == "ray":
        from batchgen.executors.ray_executor import run_job_on_ray

        return run_job_on_ray(job, job_path)
    return run_job(job, job_path)


def _assert_exactly_once_and_equal(run_path: Path, local_run: Path, n: int = 1) -> None:
    got = results(run_path).sort("id", "n_index")
    want = results(local_run).sort("id", "n_index")
    assert got.height == ROWS * n
    assert got.select("id", "n_index").n_unique() == ROWS * n
    assert (got["status"] == "ok").all()
    assert got["text"].to_list() == want["text"].to_list()
    assert got["seed"].to_list() == want["seed"].to_list()
    assert got["cluster_id"].to_list() == want["cluster_id"].to_list()
    # Every live part's ids are its own: nothing is counted twice in the manifest.
    lines = manifest(run_path)
    assert sum(e["rows"] for e in lines) == ROWS * n
    assert not (run_path / "staging").exists()


def test_ray_matches_local_seeded(ray_cluster, tiny_model_dir, tmp_path):
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "n": 2, "max_tokens": 6}
    batching = {"cluster": "auto", "num_clusters": 3}
    local, on_ray = _jobs(tiny_model_dir, tmp_path, sampling=sampling, batching=batching)
    assert _run_in_process(local).exit_code == 0
    outcome = _run_in_process(on_ray)
    assert outcome.exit_code == 0, outcome.message
    _assert_exactly_once_and_equal(tmp_path / "ray" / "run", tmp_path / "local" / "run", n=2)
    clusters = results(tmp_path / "ray" / "run")["cluster_id"]
    assert clusters.null_count() == 0 and clusters.n_unique() > 1
    lines = manifest(tmp_path / "ray" / "run")
    assert all(e["worker"] for e in lines)  # each part names the worker that wrote it
    report = json.loads((tmp_path / "ray" / "run" / "report.json").read_text())
    assert report["rows_committed"] == ROWS
    assert sum(w["rows"] for w in report["workers"].values()) == ROWS * 2


def _kill_a_worker_after_first_part(run_path: Path, killed: list) -> None:
    deadline = time.time() + 200
    while not manifest(run_path) and time.time() < deadline:
        time.sleep(0.05)
    for path in sorted((run_path / "workers").glob("*.json")):
        pid = json.loads(path.read_text())["pid"]
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
            killed.append((pid, len(manifest(run_path))))
            return


def test_worker_killed_mid_run_completes_exactly_once(ray_cluster, tiny_model_dir, tmp_path):
    local, on_ray = _jobs(tiny_model_dir, tmp_path)
    assert _run_in_process(local).exit_code == 0
    run_path = tmp_path / "ray" / "run"
    killed: list[tuple[int, int]] = []  # (pid, parts committed when it was killed)
    killer = threading.Thread(target=_kill_a_worker_after_first_part, args=(run_path, killed))
    killer.start()
    outcome = _run_in_process(on_ray)
    killer.join()
    assert killed, "no worker was found to kill"
    assert outcome.exit_code == 0, outcome.message
    blocks = ROWS // 10
    assert killed[0][1] < blocks  # it was mid-run: parts were still to come
    _assert_exactly_once_and_equal(run_path, tmp_path / "local" / "run")


def test_driver_killed_then_rerun_completes_exactly_once(ray_cluster, tiny_model_dir, tmp_path):
    rows = int_id_rows(ROWS, task=lambda i: f"task-{i % 3}")
    local, on_ray = _jobs(tiny_model_dir, tmp_path, rows, batching={"cluster": "task"})
    run_path = tmp_path / "ray" / "run"
    # The driver is its own process connected to the test's cluster, so it can be killed.
    raw = on_ray.read_text().replace("type: ray", f"type: ray\n  address: '{ray_cluster}'")
    on_ray.write_text(raw)
    assert load_job(on_ray).executor.address == ray_cluster
    driver = start(on_ray)
    try:
        deadline = time.time() + 200
        while not manifest(run_path):
            assert driver.poll() is None, driver.stdout.read().decode()
            assert time.time() < deadline, "the driver committed no part in time"
            time.sleep(0.05)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    committed_before = {e["part"]: e["checksum"] for e in manifest(run_path)}
    assert 0 < sum(e["rows"] for e in manifest(run_path)) < ROWS

    assert _run_in_process(local).exit_code == 0
    outcome = _run_in_process(on_ray)
    assert outcome.exit_code == 0, outcome.message
    _assert_exactly_once_and_equal(run_path, tmp_path / "local" / "run")
    # What the killed driver committed stands, as committed.
    after = {e["part"]: e["checksum"] for e in manifest(run_path)}
    assert all(after.get(part) == checksum for part, checksum in committed_before.items())
    # Parts its workers staged but it never recorded were set aside, not counted.
    for note in (run_path / "quarantine").glob("*/reasons.jsonl"):
        for line in note.read_text().splitlines():
            assert "no driver recorded" in json.loads(line)["reason"]


def test_a_failed_ray_job_is_told_by_the_worker_error_it_wraps():
    from batchgen.executors.ray_executor import _root_cause

    try:
        try:
            raise ValueError("block 2 (part-00003.parquet) arrived with 1 of its 5 rows")
        except ValueError as inner:
            raise ray.exceptions.RayError("UDF failed to process a data block.") from inner
    except ray.exceptions.RayError as exc:
        message = _root_cause(exc)
    assert message == "ValueError: block 2 (part-00003.parquet) arrived with 1 of its 5 rows"


def test_object_storage_run_dir_commits_and_resumes_exactly_once(
    ray_cluster, tiny_model_dir, tmp_path
):
    # A file:// URI takes the object-storage path (batchgen.store_path over pyarrow.fs),
    # the one s3:// and gs:// take, on a filesystem this machine has.
    batching = {"cluster": "auto", "num_clusters": 3}
    local, on_ray = _jobs(tiny_model_dir, tmp_path, batching=batching)
    run_path = tmp_path / "ray" / "run"
    on_ray.write_text(on_ray.read_text().replace(str(run_path), f"file://{run_path}"))
    assert load_job(on_ray).output.path == f"file://{run_path}"
    assert _run_in_process(local).exit_code == 0
    outcome = _run_in_process(on_ray)
    assert outcome.exit_code == 0, outcome.message
    _assert_exactly_once_and_equal(run_path, tmp_path / "local" / "run")
    assert not (tmp_path / "ray" / ".run.lock").exists()  # the store's path: no flock file
    # Clusters were built in scratch space and published without the embedding cache.
    assert sorted(p.name for p in (run_path / "clusters").iterdir()) == [
        "assignments.parquet",
        "clusters.json",
    ]

    # The driver stopped after moving the last part into results/ but before its line
    # (that part is adopted), and the part before it was lost with its line (its rows
    # run again).
    lines = (run_path / "_manifest.jsonl").read_text().splitlines(keepends=True)
    lost, unrecorded = json.loads(lines[-2])["part"], json.loads(lines[-1])["part"]
    (run_path / "_manifest.jsonl").write_text("".join(lines[:-2]))
    (run_path / "results" / lost).unlink()
    (run_path / "_SUCCESS").unlink()
    outcome = _run_in_process(on_ray)
    assert outcome.exit_code == 0, outcome.message
    _assert_exactly_once_and_equal(run_path, tmp_path / "local" / "run")
    after = manifest(run_path)
    assert unrecorded in {e["part"] for e in after}
    assert len({e["session"] for e in after}) == 2  # the lost rows ran in a new session
    verified = CliRunner().invoke(report_cmd, [f"file://{run_path}", "--verify"])
    assert verified.exit_code == 0, verified.output


def test_a_request_file_is_refused_on_ray_with_nothing_written(tiny_model_dir, tmp_path):
    from batchgen.executors.ray_executor import run_job_on_ray

    data = write_jsonl(tmp_path / "in.jsonl", [openai_chat(f"r{i}", "Hello") for i in range(3)])
    job = parse_job({**batch_job(tmp_path, data, str(tiny_model_dir)), "executor": {"type": "ray"}})
    with pytest.raises(JobError, match="input.format: openai_batch request files run on the local"):
        run_job_on_ray(job, "job.yaml")
    assert not (tmp_path / "run").exists()


def test_an_input_column_named_like_the_row_positions_is_refused(tiny_model_dir, tmp_path):
    from batchgen.executors.blocks import SEQ_COLUMN
    from batchgen.executors.ray_executor import run_job_on_ray

    rows = int_id_rows(3, **{SEQ_COLUMN: lambda i: i})
    path = job_file(tiny_model_dir, tmp_path, rows, tmp_path / "run", executor=RAY_EXECUTOR)
    with pytest.raises(JobError, match=f"input column '{SEQ_COLUMN}' in .*in.parquet"):
        run_job_on_ray(load_job(path), path)
    assert not (tmp_path / "run").exists()
