"""The run loop: read -> skip committed -> render -> plan -> engine.stream -> parts.

Every stage is a generator, so memory is bounded by the engine's waiting queue plus the
planner's window, whatever the input size. Rows that cannot run (null or empty prompt,
prompt over the context) and rows the engine rejects become error rows; the job goes on
until the error budget is spent.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from batchgen.engine_faults import EngineFaultLog
from batchgen.engine_supervisor import (
    EngineFailure,
    EngineFault,
    EngineGaveUp,
    EngineSupervisor,
)
from batchgen.job_context import JobContext, open_job
from batchgen.job_engine import load_llm
from batchgen.job_lengths import expected_seq_len
from batchgen.job_spec import JobError, JobSpec
from batchgen.planner import ClusterLabels, cluster_mode, log_cluster_mode, plan_rows
from batchgen.progress import Progress
from batchgen.report import write_report
from batchgen.request_feed import RequestFeed, parse_request_id
from batchgen.resume import (
    check_run_dir,
    committed_ids,
    open_run_dir,
    schema_for_run,
    take_back_errors,
)
from batchgen.row_preparer import RowPreparer
from batchgen.rows import InputRow, PreparedRow, ResultRow
from batchgen.run_dir import RunDir, new_session_id
from batchgen.run_dir_check import reconcile
from batchgen.run_lock import RunLock
from batchgen.stats import RunStats
from batchgen.stop_flag import StopFlag
from batchgen.store_path import is_uri
from batchgen.writer import PartWriter

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_SOME_ERRORS = 3
EXIT_BUDGET_EXCEEDED = 4
EXIT_INTERRUPTED = 5


def start_routing_stats(job: JobSpec, llm) -> bool:
    """Record routing statistics when the job asks for them, or by default for MoE models
    on the CPU. False when the model has no routed experts."""
    wanted = job.model.record_routing
    if wanted is None:
        runner = getattr(getattr(llm, "engine", None), "runner", None)
        wanted = runner is not None and runner.device.type == "cpu"
    return bool(wanted) and hasattr(llm, "record_routing") and llm.record_routing(True)


def save_routing_stats(run_dir: RunDir, session: str, summary: dict | None) -> None:
    """One file per session (a resumed run adds its own); the report merges them."""
    if summary is None:
        return
    path = run_dir.path / "routing" / f"{session}.json"
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, default=str))
    tmp.replace(path)


def check_response_format(job: JobSpec, llm) -> None:
    """Compile the job's sampling.response_format once before any work: a schema or regex
    that does not compile refuses the job (JobError, exit 2), not every row."""
    engine = getattr(llm, "engine", None)
    grammars = getattr(engine, "grammars", None)
    s = job.sampling
    if grammars is None or s.response_format is None:
        return
    from engine.structured_output import grammar_spec
    from engine.structured_output.compiler import GrammarError

    spec = grammar_spec(s.response_format, s.json_whitespace)
    if spec is None:
        return
    try:
        grammars.compile(spec)
    except GrammarError as exc:
        raise JobError(f"sampling.response_format: {exc}") from None


def make_renderer(ctx: JobContext, llm) -> RowPreparer:
    if llm.tokenizer is None:
        raise JobError(
            f"model.path: {ctx.job.model.path} has no tokenizer, so text prompts cannot be "
            "rendered; use a model directory with tokenizer files"
        )
    return RowPreparer(ctx.job, llm.tokenizer, llm.max_model_len, ctx.carry_map, ctx.format)


@dataclass
class RunOutcome:
    exit_code: int
    run_dir: Path
    message: str
    stats: RunStats | None = None


def logprob_records(entries) -> list[dict] | None:
    """The results' `logprobs` column value of a completion (engine TokenLogprob list)."""
    if entries is None:
        return None

    def record(e) -> dict:
        return {"token": e.token, "token_id": e.token_id, "bytes": e.bytes, "logprob": e.logprob}

    return [{**record(e), "top_logprobs": [record(t) for t in e.top]} for e in entries]


def _error_results(
    row: PreparedRow, n_indexes: Iterable[int], error_type: str, message: str
) -> list[ResultRow]:
    return [
        ResultRow(
            id=row.id,
            n_index=k,
            status="error",
            text=None,
            finish_reason=None,
            prompt_tokens=row.num_prompt_tokens,
            completion_tokens=0,
            cluster_id=row.group,
            error=message,
            error_type=error_type,
            seed=None,
            carry=row.carry,
            seq=row.seq,
        )
        for k in n_indexes
    ]


class RunLoop:
    """Rows through the engine into a writer: one session of a local run, or one block
    of a Ray worker. The feed gives the engine its requests; finished rows (from the
    engine, or errors found before it) go to `_finish_row`. An engine failure commits
    what finished, requeues the rows in flight and rebuilds the engine (`_recover`); rows
    in the failing step of two failures run alone once the engine works again.

    `rows` are the input rows to run (committed ones already left out), in input order;
    `budget_rows` is how many error result rows stop the loop (default: the job's
    budget over its whole input)."""

    def __init__(
        self,
        ctx,
        engine,
        renderer,
        writer,
        stats,
        progress,
        rows: Iterable[InputRow],
        labels,
        spill_dir,
        budget_rows: float | None = None,
    ):
        self.ctx = ctx
        self.job = ctx.job
        self.engine: EngineSupervisor = engine
        self.renderer = renderer
        self.writer = writer
        self.stats = stats
        self.progress = progress
        self.rows = rows
        self.labels = labels
        self.n = ctx.job.sampling.n
        self.stop = StopFlag()
        if budget_rows is None:
            budget_rows = ctx.job.errors.budget * ctx.total_rows * self.n
        self.budget_rows = budget_rows
        self.budget_exceeded = False
        self.gave_up: str | None = None  # why the engine was given up on
        self.feed = RequestFeed(
            self.job,
            plan_rows(
                self._prepared(),
                self.job.batching,
                spill_dir,
                first_group=labels.largest_group() if labels is not None else None,
            ),
            on_error_row=self._on_error_row,
            should_stop=lambda: self.stop.requested or self.budget_exceeded,
        )

    def _prepared(self) -> Iterator[PreparedRow]:
        for row in self.rows:
            self.writer.expect(row.seq)  # in input order, before the planner reorders
            yield self._prepare(row)

    def _prepare(self, row: InputRow) -> PreparedRow:
        prepared = self.renderer.prepare(row)
        if self.labels is not None:
            prepared.group = self.labels.assign(row)
        return prepared

    def _on_error_row(self, row: PreparedRow) -> None:
        n = row.num_completions(self.n)
        self._finish_row(_error_results(row, range(n), row.error.type, row.error.message))

    def on_output(self, out) -> None:
        pending = self.feed.pending_row(out.request_id)
        row = pending.row
        k = parse_request_id(out.request_id)[1]
        if out.error is not None or not out.outputs:
            message = out.error or "the engine returned no completion"
            result = _error_results(row, [k], "engine_rejected", message)[0]
        else:
            completion = out.outputs[0]
            result = ResultRow(
                id=row.id,
                n_index=k,
                status="ok",
                text=completion.text,
                finish_reason=completion.finish_reason,
                prompt_tokens=out.num_prompt_tokens or row.num_prompt_tokens,
                completion_tokens=len(completion.token_ids),
                cluster_id=row.group,
                error=None,
                error_type=None,
                seed=pending.seeds[k],
                carry=row.carry,
                seq=row.seq,
                cached_prompt_tokens=completion.cached_prompt_tokens,
                logprobs=logprob_records(completion.logprobs),
            )
            self.engine.row_ok()
            if self.feed.suspects:
                # The engine works again: let it drain, then run the suspects alone.
                self.feed.pause()
        results = self.feed.complete(out.request_id, result)
        if results is not None:
            self._finish_row(results)

    def _finish_row(self, results: list[ResultRow]) -> None:
        self.writer.add(results)
        self.stats.record_row(results)
        # The budget is a fraction of the result rows; a row with its own n adds or
        # takes away completions from the job's rows x n as it finishes.
        self.budget_rows += self.job.errors.budget * (len(results) - self.n)
        if self.stats.errors_total > self.budget_rows:
            self.budget_exceeded = True
        self.progress.update(self.stats)

    def run(self) -> str:
        """Drive the engine until the input is done, the budget is spent, Ctrl-C, or the
        engine cannot be brought back. Returns "done", "budget", "interrupted" or
        "engine_failed" (then `gave_up` says why)."""
        try:
            # SIGINT or SIGTERM: finish the rows in flight within the grace period.
            with self.stop.installed(graceful=True):
                self._drive()
        except KeyboardInterrupt:
            self.stop.requested = True
        except EngineGaveUp as exc:
            self.gave_up = str(exc)
            log.error("stopping: %s", exc)
        finally:
            self.writer.flush()
        if self.gave_up is not None:
            return "engine_failed"
        if self.budget_exceeded:
            return "budget"
        if self.stop.requested or not self.feed.done:
            return "interrupted"
        return "done"

    def _drive(self) -> None:
        while True:
            fault = self._stream(self.feed.requests())
            if self.stop.requested or self.budget_exceeded:
                return
            if fault is not None:
                self._recover(fault)
            elif self.feed.suspects:
                self._run_suspects_alone()
            else:
                return  # the planner is done and every row it gave has finished
            self.stats.engine_restarts = self.engine.restarts

    def _stream(self, requests: Iterable) -> EngineFault | None:
        """Run the engine over `requests`; the fault if it failed, else None."""
        try:
            for out in self.engine.stream(requests):
                self.on_output(out)
        except EngineFailure as failure:
            return failure.fault
        return None

    def _recover(self, fault: EngineFault) -> None:
        # What finished is committed first: the rebuild may not come back.
        self.writer.commit_ready()
        in_flight = len(self.feed.pending) - len(self.feed.suspects)
        self.engine.faults.append(
            "step_failed",
            error=fault.error,
            out_of_memory=fault.out_of_memory,
            rows_in_flight=in_flight,
            traceback=fault.traceback,
        )
        log.warning(
            "the engine failed during a step (%s); %d rows in flight go back to the queue",
            fault.error,
            in_flight,
        )
        self.engine.count_failure(fault.error)
        for pending in self.feed.requeue_after_failure(fault.in_step):
            log.warning(
                "row %s was in the failing step of %d engine failures: it will run alone",
                pending.row.id,
                pending.failures,
            )
        self.engine.restart(fault)

    def _run_suspects_alone(self) -> None:
        """Each suspect row with nothing else in flight. Failing alone makes it an error
        row (error_type engine_error); the engine is rebuilt and the job goes on."""
        while self.feed.suspects and not (self.stop.requested or self.budget_exceeded):
            pending = self.feed.next_suspect()
            row = pending.row
            # No request finished since the last failure: first make sure the engine
            # runs at all, or every suspect of a broken engine would become an error row.
            if self.engine.streak and not self.engine.probe(row.prompt_token_ids):
                continue  # it did not: rebuilt (or EngineGaveUp at the limit)
            log.info("running row %s alone", row.id)
            fault = self._stream(self.feed.run_alone(pending))
            if fault is None:
                continue
            message = (
                "the engine failed with this row alone, after failing twice with it in a "
                f"batch: {fault.error}"
            )
            log.warning("row %s failed alone: it becomes an error row (%s)", row.id, fault.error)
            self.engine.faults.append(
                "row_failed_alone", id=row.id, error=fault.error, traceback=fault.traceback
            )
            n = len(pending.seeds)
            missing = [k for k in range(n) if k not in pending.results]
            results = {**pending.results}
            for result in _error_results(row, missing, "engine_error", message):
                results[result.n_index] = result
            self.feed.drop(pending)
            self._finish_row([results[k] for k in range(n)])
            self.engine.restart(fault, shrink=False)


def run_job(
    job: JobSpec,
    job_path: str | Path,
    *,
    new_run: bool = False,
    retry_errors: bool = False,
    llm=None,
    progress: Progress | None = None,
) -> RunOutcome:
    """Run (or resume) a job. Raises JobError before writing anything if the job cannot
    run (another run holding its output directory included), PartWriteError when the OS
    refuses to write a part (resumable); otherwise returns the exit code and a one-line
    summary."""
    if is_uri(job.output.path):
        raise JobError(
            f"output.path: {job.output.path} is on object storage, which the local executor "
            "does not write to; run the job with `executor: {type: ray}` (or --executor "
            "ray), or give output.path as a filesystem path"
        )
    ctx = open_job(job)
    stop = StopFlag()  # reads BATCHGEN_STOP_GRACE_S: a bad value is refused before any work
    # The lock is taken before the run directory is looked at and held to the end.
    with RunLock(job.output.path), stop.installed(graceful=False):
        try:
            return _run_locked(ctx, job, job_path, new_run, retry_errors, llm, progress)
        except KeyboardInterrupt:
            # A signal outside generation (loading, clustering, the report): nothing was
            # in flight, every committed part stands.
            return RunOutcome(
                EXIT_INTERRUPTED,
                Path(job.output.path),
                f"interrupted; committed rows are kept; resume with `batchgen run {job_path}`",
            )


def _run_locked(
    ctx: JobContext,
    job: JobSpec,
    job_path: str | Path,
    new_run: bool,
    retry_errors: bool,
    llm,
    progress: Progress | None,
) -> RunOutcome:
    session_id = new_session_id()
    finished, reconciled = check_session(ctx, job, job_path, new_run, retry_errors, session_id)
    if finished is not None:
        return finished
    if llm is None:
        # the engine sizes its batch by the job's lengths unless the job sets max_num_seqs
        expected = None if job.batching.max_num_seqs else expected_seq_len(ctx)
        llm = load_llm(job, expected_seq_len=expected)
    check_response_format(job, llm)
    recording = start_routing_stats(job, llm)
    renderer = make_renderer(ctx, llm)

    session = open_session(
        ctx, job, job_path, new_run, retry_errors, session_id, reconciled, progress
    )
    run_dir, stats, progress, labels = (
        session.run_dir,
        session.stats,
        session.progress,
        session.labels,
    )
    writer = PartWriter(
        run_dir,
        schema_for_run(run_dir, ctx.schema),
        job.output.rows_per_part,
        model=getattr(llm, "model_name", job.model.path),
        fingerprint=job.fingerprint,
        session=session_id,
        in_input_order=job.output.order == "input",
    )
    run_dir.save_engine_choice("expert_placement", getattr(llm, "expert_placement", None))
    run_dir.save_engine_choice("batch_size", getattr(llm, "batch_size_choice", None))
    engine = supervise_engine(llm, job, run_dir, session_id, recording)
    del llm  # the supervisor holds the one reference, so a restart frees the old engine
    rows = (row for row in ctx.input.rows() if row.id not in session.done_ids)
    loop = RunLoop(
        ctx, engine, renderer, writer, stats, progress, rows, labels, run_dir.path / "plan"
    )
    progress.start(stats, title=f"batchgen run {job_path}")
    started = time.time()
    try:
        state = loop.run()
    finally:
        progress.finish(stats)

    if recording and engine.llm is not None:
        save_routing_stats(run_dir, session_id, engine.llm.routing_stats())
    outcome = conclude_session(session, job, job_path, ctx, state, loop.gave_up)
    log.info("session took %.1fs", time.time() - started)
    return outcome


@dataclass
class Session:
    """One session of a run, whatever executes it: the run directory (reconciled, under
    the caller's run lock), what earlier sessions committed, the counters and display,
    and the cluster labels rows get."""

    id: str
    run_dir: RunDir
    archived: str | None
    done_ids: set[str]
    stats: RunStats
    progress: Progress
    labels: object | None  # planner.ClusterLabels or task_clusters.AssignmentCursor


def check_session(
    ctx: JobContext,
    job: JobSpec,
    job_path: str | Path,
    new_run: bool,
    retry_errors: bool,
    session_id: str,
) -> tuple[RunOutcome | None, bool]:
    """The checks before any engine is built: the run directory against the job (an
    existing one reconciled), the fault-injection variable. Returns the outcome when every
    row is committed already (the report rewritten, nothing run), and whether the run
    directory was reconciled."""
    check_run_dir(job, new_run)
    check_fault_injection()
    log_cluster_mode(job.batching)
    if new_run or not RunDir(job.output.path).exists():
        return None, False
    run_dir = RunDir(job.output.path)
    reconcile(run_dir, job.fingerprint, session_id)
    if not retry_errors and _every_id_committed(run_dir, ctx):
        # Nothing to do: the report is rewritten, no model is loaded.
        log.info("every input row is already committed: nothing to run")
        code, message = _conclude(run_dir, job, job_path, ctx, "done", _stored_labels(job))
        return RunOutcome(code, run_dir.path, message), True
    return None, True


def open_session(
    ctx: JobContext,
    job: JobSpec,
    job_path: str | Path,
    new_run: bool,
    retry_errors: bool,
    session_id: str,
    reconciled: bool,
    progress: Progress | None,
) -> Session:
    """Open (or create) the run directory for a session that will run rows, take back
    the error rows for --retry-errors, and cluster the input (`cluster: auto`; stored in
    the run directory, so a resumed session reloads it)."""
    run_dir, archived = open_run_dir(job, new_run, job_path)
    if not reconciled:
        reconcile(run_dir, job.fingerprint, session_id)
    run_dir.success.unlink(missing_ok=True)
    if retry_errors:
        retried = take_back_errors(run_dir, job.fingerprint, session_id)
        log.info("--retry-errors: %d rows will run again", retried)
    done_ids, _, errors_before = committed_ids(run_dir)

    stats = RunStats(
        rows_total=ctx.total_rows,
        n=job.sampling.n,
        rows_done_before=len(done_ids),
        errors_before=errors_before,
    )
    progress = progress or Progress(run_dir.progress_file)
    labels = None
    if cluster_mode(job.batching) == "column":
        labels = ClusterLabels(job.batching.cluster, run_dir.clusters_file)
    elif cluster_mode(job.batching) == "auto":
        from batchgen.task_clusters import cluster_job  # pulls in scikit-learn

        # Embeds every input row once (cached in the run dir: a resumed run reloads it).
        clusters = cluster_job(
            job, ctx.input.rows(), run_dir.path / "clusters", progress.phase, ctx.total_rows
        )
        labels = clusters.cursor()
    return Session(session_id, run_dir, archived, done_ids, stats, progress, labels)


def conclude_session(
    session: Session,
    job: JobSpec,
    job_path: str | Path,
    ctx: JobContext,
    state: str,
    gave_up: str | None = None,
) -> RunOutcome:
    """The session's outcome, counted from the manifest; writes the report."""
    labels = session.labels.names() if session.labels is not None else None
    code, message = _conclude(session.run_dir, job, job_path, ctx, state, labels, gave_up)
    if session.archived:
        message += f" (previous run moved to {session.archived})"
    return RunOutcome(code, session.run_dir.path, message, session.stats)


def check_fault_injection() -> None:
    """Refuse a malformed BATCHGEN_FAULT_INJECT before any work (JobError, exit 2)."""
    from engine.fault_injection import FaultSpecError, from_environment

    try:
        from_environment()
    except FaultSpecError as exc:
        raise JobError(str(exc)) from None


def _every_id_committed(run_dir: RunDir, ctx: JobContext) -> bool:
    done_ids, _, _ = committed_ids(run_dir)
    return len(done_ids) >= ctx.total_rows and all(i in done_ids for i in ctx.input.ids())


def _stored_labels(job: JobSpec) -> dict[int, str] | None:
    """The cluster names a finished run stored, for its report (nothing is embedded)."""
    run_dir = RunDir(job.output.path)
    if cluster_mode(job.batching) == "column":
        return ClusterLabels(job.batching.cluster, run_dir.clusters_file).names()
    if cluster_mode(job.batching) == "auto":
        from batchgen.task_clusters import load_task_clusters

        stored = load_task_clusters(run_dir.path / "clusters")
        return stored.names() if stored is not None else None
    return None


def supervise_engine(llm, job: JobSpec, run_dir: RunDir, session: str, recording: bool):
    """The engine's supervisor: a rebuilt engine records routing like the first, and the
    routing an engine recorded is saved before it is dropped."""
    retired = 0

    def build(max_num_seqs: int | None):
        new = load_llm(job, max_num_seqs=max_num_seqs)
        start_routing_stats(job, new)
        return new

    def retire(old) -> None:
        nonlocal retired
        retired += 1
        if recording:
            save_routing_stats(run_dir, f"{session}.{retired}", old.routing_stats())

    return EngineSupervisor(llm, build, retire, EngineFaultLog(run_dir.path, session))


def _conclude(
    run_dir: RunDir,
    job: JobSpec,
    job_path,
    ctx: JobContext,
    state: str,
    labels: dict[int, str] | None,
    gave_up: str | None = None,
) -> tuple[int, str]:
    """The exit code and summary line, counted from the manifest (so the verdict covers
    every session of this run); writes the report, and _SUCCESS when finished."""
    done_ids, _, error_rows = committed_ids(run_dir)
    complete = len(done_ids) == ctx.total_rows
    if state == "budget":
        code = EXIT_BUDGET_EXCEEDED
    elif state in ("interrupted", "engine_failed") or not complete:
        code = EXIT_INTERRUPTED
    elif error_rows:
        code = EXIT_SOME_ERRORS
    else:
        code = EXIT_OK
    write_report(run_dir, job, job_path, exit_code=code, total_rows=ctx.total_rows, labels=labels)
    if code in (EXIT_OK, EXIT_SOME_ERRORS):
        run_dir.success.write_text("")
    message = _summary(code, run_dir, len(done_ids), ctx.total_rows, error_rows, job_path)
    if code in (EXIT_OK, EXIT_SOME_ERRORS) and job.output.export is not None:
        from batchgen.batch_api.export import export_run

        export_dir = run_dir.path / "export"
        export_run(run_dir.path, job.output.export, export_dir)
        message += f" (exported as {job.output.export} to {export_dir})"
    if gave_up is not None:
        message = f"stopped: {gave_up}; " + message.removeprefix("interrupted: ")
    return code, message


def _summary(code: int, run_dir: RunDir, done: int, total: int, errors: int, job_path) -> str:
    if code == EXIT_OK:
        return f"done: {done:,} rows ok -> {run_dir.path}"
    if code == EXIT_SOME_ERRORS:
        return f"done with errors: {done:,} rows, {errors:,} error rows -> {run_dir.path}"
    if code == EXIT_BUDGET_EXCEEDED:
        return (
            f"stopped: {errors:,} error rows exceed the error budget; see "
            f"{run_dir.path}/report.md; fix and resume with `batchgen run {job_path}` "
            "(add --retry-errors to rerun the failed rows)"
        )
    return (
        f"interrupted: {done:,} of {total:,} rows committed; resume with `batchgen run {job_path}`"
    )
