"""`batchgen run JOB`: run or resume a job. Exit codes: 0 all ok, 3 finished with errors
within the budget, 4 budget exceeded, 5 interrupted (rerun to resume), 2 job refused."""

from __future__ import annotations

import errno
import logging
import sys

import click

from batchgen.job_spec import JobError, load_job

# OS errors a run stops on and resumes after, once the cause is fixed (space freed, disk
# remounted); committed parts are intact (tmp -> fsync -> rename).
_RESUMABLE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )


def _os_error_line(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.filename:
        return f"writing {exc.filename} failed: [Errno {exc.errno}] {exc.strerror}"
    return str(exc)


def refuse(exc: JobError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


@click.command("run")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--new-run", is_flag=True, help="Start over if the job changed (old run kept).")
@click.option("--retry-errors", is_flag=True, help="Run the rows that failed before again.")
@click.option(
    "--progress-interval",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds between JSON progress lines when not on a terminal.",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default=None,
    help="Where the rows run (default: the job file's executor.type, else local).",
)
def run_cmd(
    job_file: str,
    new_run: bool,
    retry_errors: bool,
    progress_interval: float,
    executor: str | None,
) -> None:
    """Run JOB_FILE; the same command after a crash resumes where it stopped."""
    from batchgen.progress import Progress
    from batchgen.run import EXIT_INTERRUPTED, run_job
    from batchgen.run_dir import RunDir
    from batchgen.writer import PartWriteError

    setup_logging()
    try:
        job = load_job(job_file)
        if executor is not None:
            job = job.model_copy(
                update={"executor": job.executor.model_copy(update={"type": executor})}
            )
        progress = Progress(RunDir(job.output.path).progress_file, interval=progress_interval)
        if job.executor.type == "ray":
            from batchgen.executors.ray_executor import run_job_on_ray

            outcome = run_job_on_ray(
                job, job_file, new_run=new_run, retry_errors=retry_errors, progress=progress
            )
        else:
            outcome = run_job(
                job, job_file, new_run=new_run, retry_errors=retry_errors, progress=progress
            )
    except JobError as exc:
        refuse(exc)
    except (PartWriteError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in _RESUMABLE_ERRNOS:
            raise
        click.echo(
            f"error: {_os_error_line(exc)}; committed parts are intact: fix the cause and "
            f"resume with `batchgen run {job_file}`",
            err=True,
        )
        sys.exit(EXIT_INTERRUPTED)
    click.echo(outcome.message)
    sys.exit(outcome.exit_code)


commands = [run_cmd]
