"""The run loop: read -> skip committed -> render -> plan -> engine.stream -> parts.

Every stage is a generator, so memory is bounded by the engine's waiting queue plus the
planner's window, whatever the input size. Rows that cannot run (null or empty prompt,
prompt over the context) and rows the engine rejects become error rows; the job goes on
until the error budget is spent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.job_context import JobContext, open_job
from batchgen.job_spec import JobError, JobSpec
from batchgen.planner import ClusterLabels, cluster_mode, log_cluster_mode, plan_rows
from batchgen.progress import Progress
from batchgen.render import PromptRenderer
from batchgen.report import write_report
from batchgen.resume import (
    check_run_dir,
    committed_ids,
    open_run_dir,
    schema_for_run,
    take_back_errors,
)
from batchgen.rows import InputRow, PreparedRow, ResultRow
from batchgen.run_dir import RunDir, new_session_id
from batchgen.run_dir_check import reconcile
from batchgen.run_lock import RunLock
from batchgen.stats import RunStats
from batchgen.stop_flag import StopFlag
from batchgen.writer import PartWriter

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_JOB_ERROR = 2
EXIT_SOME_ERRORS = 3
EXIT_BUDGET_EXCEEDED = 4
EXIT_INTERRUPTED = 5


def derive_seed(job_seed: int, row_id: str, n_index: int) -> int:
    """The seed of one completion: a function of (job seed, row id, n_index) only, so a
    row's sample does not depend on its batch, its cluster or its position."""
    digest = hashlib.blake2b(f"{job_seed}\0{row_id}\0{n_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def load_llm(job: JobSpec):
    """The engine for a job (imported here: engine loading pulls in torch models)."""
    from engine import LLM

    kwargs = {
        "model": job.model.path,
        "device": job.model.device,
        "dtype": job.model.dtype,
        "kv_cache_memory": job.model.kv_cache_memory,
        "seed": job.sampling.seed,
    }
    if job.model.max_model_len is not None:
        kwargs["max_model_len"] = job.model.max_model_len
    if job.batching.max_num_seqs is not None:
        kwargs["max_num_seqs"] = job.batching.max_num_seqs
    if job.batching.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = job.batching.max_num_batched_tokens
    return LLM(**kwargs)


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


def make_renderer(ctx: JobContext, llm) -> PromptRenderer:
    if llm.tokenizer is None:
        raise JobError(
            f"model.path: {ctx.job.model.path} has no tokenizer, so text prompts cannot be "
            "rendered; use a model directory with tokenizer files"
        )
    return PromptRenderer(
        ctx.job.prompt,
        llm.tokenizer,
        llm.max_model_len,
        ctx.job.sampling.max_tokens,
        ctx.carry_map,
    )


def sampling_params(job: JobSpec, seed: int):
    from engine import SamplingParams

    s = job.sampling
    return SamplingParams(
        n=1,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_tokens=s.max_tokens,
        stop=list(s.stop or []),
        seed=seed,
    )


@dataclass
class RunOutcome:
    exit_code: int
    run_dir: Path
    message: str
    stats: RunStats | None = None


@dataclass
class _Pending:
    row: PreparedRow
    seeds: list[int]  # one per n_index, derived once when the requests are made
    results: dict[int, ResultRow] = field(default_factory=dict)


def _error_results(row: PreparedRow, n: int, error_type: str, message: str) -> list[ResultRow]:
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
        for k in range(n)
    ]


class _Loop:
    """One session of a run. `requests()` is the generator the engine pulls from; finished
    rows (from the engine, or errors found before it) go to `_finish_row`."""

    def __init__(self, ctx, llm, renderer, writer, stats, progress, done_ids, labels):
        self.ctx = ctx
        self.job = ctx.job
        self.llm = llm
        self.renderer = renderer
        self.writer = writer
        self.stats = stats
        self.progress = progress
        self.done_ids = done_ids
        self.labels = labels
        self.n = ctx.job.sampling.n
        self.pending: dict[int, _Pending] = {}
        self.stop = StopFlag()
        self.budget_rows = ctx.job.errors.budget * ctx.total_rows * self.n
        self.budget_exceeded = False
        self.fed_all = False
        self.spill_dir: Path | None = None  # where the planner spills rows by cluster

    def _prepared(self) -> Iterator[PreparedRow]:
        for row in self.ctx.input.rows():
            if row.id in self.done_ids:
                continue
            self.writer.expect(row.seq)  # in input order, before the planner reorders
            yield self._prepare(row)

    def _prepare(self, row: InputRow) -> PreparedRow:
        prepared = self.renderer.prepare(row)
        if self.labels is not None:
            prepared.group = self.labels.assign(row)
        return prepared

    def requests(self) -> Iterator:
        from engine import Request

        for row in plan_rows(self._prepared(), self.job.batching, self.spill_dir):
            if self.stop.requested or self.budget_exceeded:
                return
            if row.error is not None:
                self._finish_row(_error_results(row, self.n, row.error.type, row.error.message))
                continue
            seeds = [derive_seed(self.job.sampling.seed, row.id, k) for k in range(self.n)]
            self.pending[row.seq] = _Pending(row, seeds)
            for k, seed in enumerate(seeds):
                yield Request(
                    request_id=f"{row.seq}:{k}",
                    prompt=row.prompt_token_ids,
                    sampling_params=sampling_params(self.job, seed),
                    group=row.group,
                )
        self.fed_all = True

    def on_output(self, out) -> None:
        seq_s, k_s = out.request_id.split(":")
        seq, k = int(seq_s), int(k_s)
        pending = self.pending[seq]
        row = pending.row
        if out.error is not None or not out.outputs:
            message = out.error or "the engine returned no completion"
            result = _error_results(row, 1, "engine_rejected", message)[0]
            result.n_index = k
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
            )
        pending.results[k] = result
        if len(pending.results) == self.n:
            del self.pending[seq]
            self._finish_row([pending.results[i] for i in range(self.n)])

    def _finish_row(self, results: list[ResultRow]) -> None:
        self.writer.add(results)
        self.stats.record_row(results)
        if self.stats.errors_total > self.budget_rows:
            self.budget_exceeded = True
        self.progress.update(self.stats)

    def run(self) -> str:
        """Drive the engine until the input is done, the budget is spent or Ctrl-C.
        Returns "done", "budget" or "interrupted"."""
        try:
            # SIGINT or SIGTERM: finish the rows in flight within the grace period.
            with self.stop.installed(graceful=True):
                for out in self.llm.stream(self.requests()):
                    self.on_output(out)
        except KeyboardInterrupt:
            self.stop.requested = True
        finally:
            self.writer.flush()
        if self.budget_exceeded:
            return "budget"
        if self.stop.requested or not self.fed_all:
            return "interrupted"
        return "done"


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
    check_run_dir(job, new_run)
    log_cluster_mode(job.batching)
    if llm is None:
        llm = load_llm(job)
    recording = start_routing_stats(job, llm)
    renderer = make_renderer(ctx, llm)

    session = new_session_id()
    run_dir, archived = open_run_dir(job, new_run, job_path)
    reconcile(run_dir, job.fingerprint, session)
    run_dir.success.unlink(missing_ok=True)
    if retry_errors:
        retried = take_back_errors(run_dir, job.fingerprint, session)
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
    writer = PartWriter(
        run_dir,
        schema_for_run(run_dir, ctx.schema),
        job.output.rows_per_part,
        model=getattr(llm, "model_name", job.model.path),
        fingerprint=job.fingerprint,
        session=session,
        in_input_order=job.output.order == "input",
    )
    loop = _Loop(ctx, llm, renderer, writer, stats, progress, done_ids, labels)
    loop.spill_dir = run_dir.path / "plan"
    progress.start(stats, title=f"batchgen run {job_path}")
    started = time.time()
    try:
        state = loop.run()
    finally:
        progress.finish(stats)

    if recording:
        save_routing_stats(run_dir, session, llm.routing_stats())
    # Count from the manifest, so the verdict covers every session of this run.
    done_ids, _, error_rows = committed_ids(run_dir)
    complete = len(done_ids) == ctx.total_rows
    if state == "budget":
        code = EXIT_BUDGET_EXCEEDED
    elif state == "interrupted" or not complete:
        code = EXIT_INTERRUPTED
    elif error_rows:
        code = EXIT_SOME_ERRORS
    else:
        code = EXIT_OK
    write_report(
        run_dir,
        job,
        job_path,
        exit_code=code,
        total_rows=ctx.total_rows,
        labels=labels.names() if labels else None,
    )
    if code in (EXIT_OK, EXIT_SOME_ERRORS):
        run_dir.success.write_text("")
    message = _summary(code, run_dir, len(done_ids), ctx.total_rows, error_rows, job_path)
    if archived:
        message += f" (previous run moved to {archived})"
    log.info("session took %.1fs", time.time() - started)
    return RunOutcome(code, run_dir.path, message, stats)


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
