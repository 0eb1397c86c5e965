"""`executor: {type: ray}`: a job's rows run on a Ray cluster, one engine per worker
actor, into the run directory the local executor uses: a path every node sees, or object
storage (batchgen.store_path).

The driver (the process that ran `batchgen run`) does what the local executor does
before and after generation: the run lock, the run directory check, --retry-errors,
clustering (stored in the run directory), the report. In between it plans the input as
blocks (batchgen.executors.blocks: slices of row groups, committed rows left out) and
runs a Ray Data pipeline over them: a datasource with one read task per block
(batchgen.executors.block_source), into an actor pool (`map_batches` over a callable
class, `concurrency` = num_workers); each actor builds the engine once and runs block
after block through the local executor's RunLoop, writing each block's part under its own
staging directory. The driver commits each part as it comes back: the only writer of
_manifest.jsonl (batchgen.executors.staging).

Faults: an actor that dies (killed, out of memory, node lost) is restarted by Ray and
its block runs again (Ray Data retries the task); the copy of a block the driver sees
second is set aside. A killed driver loses its cluster's work in flight; the same
command resumes from the manifest, like the local executor.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from batchgen.executors.blocks import SEQ_COLUMN, InputBlock, plan_blocks
from batchgen.executors.ray_worker import BlockWorker, WorkerLabels
from batchgen.executors.staging import commit_staged, set_aside, set_aside_unrecorded
from batchgen.job_context import JobContext, open_job
from batchgen.job_lengths import expected_seq_len
from batchgen.job_spec import ExecutorSpec, JobError, JobSpec
from batchgen.part_check import PartDamaged
from batchgen.planner import ClusterLabels, cluster_mode
from batchgen.progress import Progress
from batchgen.resume import schema_for_run
from batchgen.run import (
    EXIT_INTERRUPTED,
    RunOutcome,
    Session,
    check_session,
    conclude_session,
    open_session,
)
from batchgen.run_dir import ManifestEntry, RunDir, new_session_id
from batchgen.run_lock import RunLock
from batchgen.stop_flag import SIGNALS, StopFlag
from batchgen.store_path import is_uri, run_path

log = logging.getLogger(__name__)

INSTALL_RAY = "pip install -e '.[ray]'"


def import_ray():
    """Ray, or JobError (exit 2) naming the install command."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise JobError(
            f"executor.type: ray needs Ray Data, which is not installed; install it with "
            f"`{INSTALL_RAY}`"
        ) from None
    return ray


def run_job_on_ray(
    job: JobSpec,
    job_path: str | Path,
    *,
    new_run: bool = False,
    retry_errors: bool = False,
    progress: Progress | None = None,
) -> RunOutcome:
    """`run_job` for `executor: ray` (same exit codes and errors)."""
    ray = import_ray()
    if is_uri(job.output.path):
        check_object_storage_job(job, new_run)
    ctx = open_job(job)
    if ctx.format != "parquet":
        raise JobError(
            f"input.format: {ctx.format} request files run on the local executor only; the "
            "Ray executor reads Parquet input by row groups"
        )
    if SEQ_COLUMN in ctx.input.schema.names:
        raise JobError(
            f"input column '{SEQ_COLUMN}' in {ctx.input.files[0]}: the Ray executor uses that "
            "name for each row's input position; rename the column"
        )
    stop = StopFlag()
    with RunLock(job.output.path), stop.installed(graceful=False):
        try:
            return _run_locked(ray, ctx, job, job_path, new_run, retry_errors, progress)
        except KeyboardInterrupt:
            return RunOutcome(
                EXIT_INTERRUPTED,
                run_path(job.output.path),
                f"interrupted; committed rows are kept; resume with `batchgen run {job_path}`",
            )


def check_object_storage_job(job: JobSpec, new_run: bool) -> None:
    """Refuse (JobError) what a run directory on object storage cannot hold: the pieces
    that live in local files by nature (batchgen.store_path says what holds there)."""
    where = f"output.path {job.output.path} is on object storage"
    if job.output.export is not None:
        raise JobError(
            f"output.export is not supported when {where}; export afterwards with "
            "`batchgen export` from a local copy of the run"
        )
    if new_run and RunDir(job.output.path).exists():
        raise JobError(
            f"--new-run is not supported when {where} and a run is there: moving it aside "
            "would copy every object; point output.path at a new prefix instead"
        )


def _run_locked(ray, ctx, job, job_path, new_run, retry_errors, progress) -> RunOutcome:
    session_id = new_session_id()
    finished, reconciled = check_session(ctx, job, job_path, new_run, retry_errors, session_id)
    if finished is not None:
        return finished
    # Connected before the run directory is opened: a cluster that cannot be reached is
    # refused with nothing written.
    with _signal_handlers_kept():
        started_ray = _connect(ray, job.executor)
        try:
            return _run_session(
                ray, ctx, job, job_path, new_run, retry_errors, progress, session_id, reconciled
            )
        finally:
            if started_ray:
                ray.shutdown()


def _run_session(
    ray, ctx, job, job_path, new_run, retry_errors, progress, session_id, reconciled
) -> RunOutcome:
    session = open_session(
        ctx, job, job_path, new_run, retry_errors, session_id, reconciled, progress
    )
    run_dir = session.run_dir
    set_aside_unrecorded(run_dir, session_id)
    labels = _worker_labels(job, ctx, session)
    # A block is one part: rows_per_part result rows, all n completions of a row together.
    block_rows = max(1, job.output.rows_per_part // job.sampling.n)
    blocks = list(plan_blocks(ctx.input, session.done_ids, block_rows, run_dir.next_part_number()))
    log.info(
        "executor: ray - %d blocks of up to %d rows on %d workers",
        len(blocks),
        block_rows,
        job.executor.num_workers,
    )
    session.progress.start(session.stats, title=f"batchgen run {job_path} (ray)")
    started = time.time()
    try:
        state, gave_up = _drive(ray, ctx, job, session, labels, blocks)
    finally:
        session.progress.finish(session.stats)
        set_aside_unrecorded(run_dir, session_id)
    outcome = conclude_session(session, job, job_path, ctx, state, gave_up)
    log.info("session took %.1fs", time.time() - started)
    return outcome


def _worker_labels(job: JobSpec, ctx: JobContext, session: Session) -> WorkerLabels:
    mode = cluster_mode(job.batching)
    if mode == "column":
        # Ids in input order over the whole input, as the local executor gives them (a
        # row's label is one of its values: none when the column is the id column).
        labels: ClusterLabels = session.labels
        if labels.column in ctx.input.value_columns():
            for value in ctx.input.column_values(labels.column):
                labels.id_for(value)
        return WorkerLabels("column", column=labels.column, ids=dict(labels.ids))
    if mode == "auto":
        return WorkerLabels("auto", assignments=session.labels.path)
    return WorkerLabels("off")


@contextmanager
def _signal_handlers_kept():
    """Put the process's SIGINT / SIGTERM handlers back on the way out: ray.init installs
    its own SIGTERM handler and leaves it there after ray.shutdown (main thread only:
    elsewhere handlers cannot be set)."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in SIGNALS} if main else {}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextmanager
def _data_context(ray):
    """Ray Data settings of the run's pipeline, put back on the way out (the driver may be
    a process that goes on using Ray Data)."""
    context = ray.data.DataContext.get_current()
    saved = context.enable_progress_bars, context.target_max_block_size
    # The driver's own progress lines and display count the run; Ray Data's bars would
    # interleave with them.
    context.enable_progress_bars = False
    # A read task's output is never split: a block reaches its worker whole, as one part.
    context.target_max_block_size = None
    try:
        yield
    finally:
        context.enable_progress_bars, context.target_max_block_size = saved


def _connect(ray, spec: ExecutorSpec) -> bool:
    """Connect to the cluster (an address; none: a running one, else a new local one).
    True when this call started Ray here, so the driver shuts it down at the end."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address=spec.address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = spec.address or "RAY_ADDRESS / a running cluster / a new local one"
        message = " ".join(str(exc).split())[:300]
        raise JobError(
            f"executor.address: cannot start or reach Ray at {where}: {message}"
        ) from None
    return True


def _actor_options(spec: ExecutorSpec) -> dict:
    resources = dict(spec.resources_per_worker or {"CPU": 1})
    options = {"num_cpus": resources.pop("CPU", 0), "num_gpus": resources.pop("GPU", 0)}
    if resources:
        options["resources"] = resources
    return options


def _drive(ray, ctx, job, session: Session, labels: WorkerLabels, blocks) -> tuple[str, str | None]:
    """Run every block; commit each part as it comes back. Returns the session's state
    ("done", "budget", "interrupted", "engine_failed") and why the engine was given up."""
    if not blocks:
        return "done", None
    spec = job.executor
    # Ray Data's classes: imported once Ray is known to be there (import_ray).
    from batchgen.executors.block_source import BlockSource

    options = _actor_options(spec)
    threads = int(options["num_cpus"]) or None
    # Reads take no CPU of their own: the workers may hold every CPU of the cluster, and
    # a read that waited for one would never run. Their number in flight is bounded.
    dataset = ray.data.read_datasource(
        BlockSource(ctx.input, blocks),
        num_cpus=0,
        concurrency=2 * spec.num_workers,
        # As many output blocks as read tasks: fewer would have Ray Data split each
        # task's output to reach its default parallelism.
        override_num_blocks=len(blocks),
    ).map_batches(
        BlockWorker,
        fn_constructor_kwargs={
            "job": job,
            "run_path": session.run_dir.path.resolve(),
            "session": session.id,
            "schema": schema_for_run(session.run_dir, ctx.schema),
            "labels": labels,
            "blocks": blocks,
            "threads": threads,
            "expected_seq_len": None if job.batching.max_num_seqs else expected_seq_len(ctx),
        },
        batch_size=1,  # one packed block per call (blocks.pack_block)
        batch_format="pyarrow",
        # A fixed pool of num_workers actors (Ray Data's `concurrency=N`, which it now
        # asks to be given as this).
        compute=ray.data.ActorPoolStrategy(size=spec.num_workers),
        **options,
    )
    budget = job.errors.budget * ctx.total_rows * job.sampling.n
    stats, stop = session.stats, StopFlag()
    committed: set[int] = set()
    with stop.installed(graceful=True), _data_context(ray):
        try:
            for row in dataset.iter_rows():
                staged = json.loads(row["staged"])
                state = _commit(session, staged, committed, blocks)
                stats.engine_restarts += staged["engine_restarts"]
                session.progress.update(stats)
                if state == "engine_failed":
                    return state, staged["gave_up"]
                if state != "done":
                    return "interrupted", None
                if stats.errors_total > budget:
                    return "budget", None
                if stop.requested:
                    return "interrupted", None
        except KeyboardInterrupt:
            return "interrupted", None
        except ray.exceptions.RayError as exc:
            message = _root_cause(exc)
            log.error("the Ray job failed: %s", message)
            return "engine_failed", f"the Ray job failed: {message}"
    return "done", None


def _root_cause(exc: BaseException) -> str:
    """The exception a Ray error wraps, as one line: a worker's own error (a bad block,
    an engine that cannot load) is what a person needs, not Ray's traceback around it."""
    seen = {id(exc)}
    while True:
        inner = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(inner, BaseException) or id(inner) in seen:
            break
        seen.add(id(inner))
        exc = inner
    text = str(exc).strip().splitlines()
    return " ".join(f"{type(exc).__name__}: {text[-1] if text else ''}".split())[:500]


def _commit(session: Session, staged: dict, committed: set[int], blocks) -> str:
    """Commit one worker's part (once per block); returns the worker loop's state."""
    block: InputBlock = blocks[staged["block"]]
    worker, run_dir = staged["worker"], session.run_dir
    if staged["block"] in committed:
        # A retried task's second output: the first copy counts.
        if staged["entry"] is not None:
            reason = f"a second copy of block {block.index} (a retried Ray task)"
            set_aside(run_dir, worker, block.part, reason, session.id)
        return "done"
    committed.add(staged["block"])
    if staged["entry"] is not None:
        entry = ManifestEntry.from_dict(staged["entry"])
        try:
            commit_staged(run_dir, worker, entry)
        except PartDamaged as exc:
            log.error(
                "the part worker %s wrote for block %d is damaged (%s); its rows run again "
                "on resume",
                worker,
                block.index,
                exc,
            )
            set_aside(run_dir, worker, block.part, f"damaged in staging: {exc}", session.id)
            return "interrupted"
    session.stats.record_block(
        staged["rows"],
        staged["ok"],
        staged["error"],
        staged["prompt_tokens"],
        staged["completion_tokens"],
        staged["finish_reasons"],
        staged["prefilled_prompt_tokens"],
        staged["cached_prompt_tokens"],
    )
    return staged["state"]
